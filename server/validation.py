"""How the round table judges a contribution: alone, and against its round.

A contribution invalid on its own (:func:`lossreduce.contribution_check.check_contribution`,
the same judgement the node aggregator makes) makes its sender the culprit of
the round; one that disagrees with the round's contract (world size, term
names, contracts of the round's first contribution) ends the round as a
contract mismatch, or, arriving after the round completed, is refused alone.
No gRPC here: the servicer and the table both build these errors.
"""

from __future__ import annotations

from collections.abc import Iterable

from lossreduce.contribution import Contribution
from lossreduce.contribution_check import ContributionProblem
from lossreduce.errors import ContractMismatchError

from .outcomes import RejectReason, RoundKey, key_error

__all__ = [
    "completed_terms_mismatch",
    "contract_mismatch",
    "late_mismatch",
    "reject_reason",
]


def reject_reason(problem: ContributionProblem) -> RejectReason:
    """The ``reason`` metric label of ``problem``."""
    return RejectReason(problem.kind.value)


def contract_mismatch(
    key: RoundKey, ref: Contribution, c: Contribution
) -> ContractMismatchError | None:
    """The contract disagreement between ``c`` and the round's first contribution, if any."""
    if c.world_size == ref.world_size and c.terms == ref.terms and c.contracts == ref.contracts:
        return None
    detail: str | None = None
    terms: tuple[str, ...] = ()
    if c.world_size != ref.world_size:
        detail = f"world_size {c.world_size} but rank {ref.rank} sent world_size {ref.world_size}"
    elif set(c.terms) != set(ref.terms):
        detail = f"terms {sorted(c.terms)} but rank {ref.rank} sent terms {sorted(ref.terms)}"
        terms = tuple(sorted(set(c.terms) ^ set(ref.terms)))
    else:
        ref_contracts = dict(zip(ref.terms, ref.contracts, strict=True))
        for term, contract in zip(c.terms, c.contracts, strict=True):
            if contract != ref_contracts[term]:
                detail = (
                    f"contract {contract!r} for term {term!r} "
                    f"but rank {ref.rank} sent {ref_contracts[term]!r}"
                )
                terms = (term,)
                break
    if detail is None:
        return None  # same terms and contracts, in another order
    return key_error(
        ContractMismatchError,
        key,
        f"rank {c.rank} sent {detail}",
        terms=terms,
        ranks=(ref.rank, c.rank),
    )


def completed_terms_mismatch(
    key: RoundKey, c: Contribution, completed_terms: Iterable[str]
) -> ContractMismatchError | None:
    """``c`` names other terms than the completed round ``key`` answered, if it does.

    The refusal of a latecomer that never counted: the round's success is not its.
    """
    known = set(completed_terms)
    if set(c.terms) == known:
        return None
    return key_error(
        ContractMismatchError,
        key,
        f"rank {c.rank} sent terms {sorted(c.terms)} but the round completed "
        f"with terms {sorted(known)}",
        terms=tuple(sorted(set(c.terms) ^ known)),
        ranks=(c.rank,),
    )


def late_mismatch(
    key: RoundKey, ref: Contribution, completed_terms: Iterable[str], c: Contribution
) -> ContractMismatchError | None:
    """How ``c``, arriving at the completed round ``key`` without a slot of its own,
    disagrees with the round's contract (``ref``, its first contribution), if it does."""
    if ref.world_size:
        return contract_mismatch(key, ref, c)
    # Restored from a journal written before rounds kept their contract: only a
    # completed round's term names are known (none when it answered no term).
    terms = tuple(completed_terms)
    if not terms:
        return None
    return completed_terms_mismatch(key, c, terms)
