"""Whether one contribution is valid on its own, judged once for every side.

The coordinator's round table refuses an invalid contribution (and aborts its
round) with the problem found here; the client's node aggregator asks the same
question before it folds a rank into an aggregate, and forwards every rank's
own request instead when the answer is no, so the coordinator names the
culprit. Judging "alone" means without the round: agreement with the round's
contract (world size, term names, contracts) is the round table's business.
The per-value rules are :mod:`lossreduce.rules`; the semantics are in
``docs/reduction-semantics.md``, "Validation".
"""

from __future__ import annotations

import math
from typing import NamedTuple

from lossreduce._compat import StrEnum
from lossreduce.contribution import DIGEST_SIZE, Contribution
from lossreduce.errors import format_terms
from lossreduce.rules import check_partial, check_term_name

__all__ = ["ContributionProblem", "ProblemKind", "check_contribution"]


class ProblemKind(StrEnum):
    """What is wrong with a contribution (the coordinator's ``reason`` metric label)."""

    NAN = "nan"
    INFINITE = "infinite"
    NEGATIVE = "negative"
    RANK_OUT_OF_RANGE = "rank_out_of_range"
    DUPLICATE_TERM = "duplicate_term"
    BAD_TERM_NAME = "bad_term_name"
    BAD_AGGREGATE = "bad_aggregate"


class ContributionProblem(NamedTuple):
    """Why one contribution is invalid on its own.

    ``detail`` completes a sentence whose subject is the sending rank
    ("rank 3 " + detail); ``terms`` and ``values`` are the offending ones.
    """

    detail: str
    kind: ProblemKind
    terms: tuple[str, ...] = ()
    values: tuple[float, ...] = ()


def check_contribution(
    c: Contribution, *, known_terms: tuple[str, ...] = ()
) -> ContributionProblem | None:
    """The first problem of ``c`` judged alone, or None when it is valid.

    Checked in this order: the rank lies in the world, there is at least one
    term, an aggregate is self-consistent, term names are well formed and
    distinct, and every partial is finite and >= 0. ``known_terms``: a term
    tuple already judged well formed and distinct (the first contribution of
    the round, or of the node); when ``c.terms`` equals it, the names are not
    judged again, which is most of the cost of a valid contribution.
    """
    if c.rank >= c.world_size:
        return ContributionProblem(
            f"is outside world_size {c.world_size} (ranks are 0..{c.world_size - 1})",
            ProblemKind.RANK_OUT_OF_RANGE,
        )
    if not c.terms:
        return ContributionProblem("sent no partials", ProblemKind.BAD_TERM_NAME)
    if c.covers:
        cover_problem = _check_cover(c)
        if cover_problem is not None:
            return cover_problem
    if c.terms != known_terms:
        names_problem = _check_names(c.terms)
        if names_problem is not None:
            return names_problem
    # The sum is NaN or infinite when any value is (a finite overflow takes the
    # slow path below and passes it); negatives show in the minimum.
    if sum(c.values) < math.inf and min(c.values) >= 0.0:  # NaN fails every comparison
        return None
    bad = [(t, v, p) for t, v in zip(c.terms, c.values, strict=True) if (p := check_partial(v))]
    if not bad:
        return None
    terms = tuple(t for t, _, _ in bad)
    values = tuple(v for _, v, _ in bad)
    return ContributionProblem(
        f"sent invalid partial {format_terms(terms, values)}; partials must be finite and >= 0",
        ProblemKind(bad[0][2].value),
        terms,
        values,
    )


def _check_names(terms: tuple[str, ...]) -> ContributionProblem | None:
    for term in terms:
        problem = check_term_name(term)
        if problem is not None:
            return ContributionProblem(
                f"sent a malformed term: {problem}", ProblemKind.BAD_TERM_NAME, (term,)
            )
    if len(set(terms)) != len(terms):
        dupes = tuple(sorted({t for t in terms if terms.count(t) > 1}))
        return ContributionProblem(
            f"sent terms {list(dupes)} more than once", ProblemKind.DUPLICATE_TERM, dupes
        )
    return None


def _expansion_sum(expansion: tuple[float, ...]) -> float:
    try:
        return math.fsum(expansion)
    except (ValueError, OverflowError):  # inf - inf, or an overflowing exact sum
        return math.nan


def _check_cover(c: Contribution) -> ContributionProblem | None:
    """An aggregated contribution's own consistency (its ranks were judged by the aggregator)."""
    covers = c.covers
    if covers[0] != c.rank or covers != tuple(sorted(set(covers))):
        return ContributionProblem(
            f"sent covered_ranks {list(covers)}; they must be strictly increasing and start "
            "at the request's rank",
            ProblemKind.BAD_AGGREGATE,
        )
    if covers[-1] >= c.world_size:
        return ContributionProblem(
            f"covers rank {covers[-1]}, outside world_size {c.world_size}",
            ProblemKind.RANK_OUT_OF_RANGE,
        )
    if c.rank_digests and (
        len(c.rank_digests) != len(covers) or any(len(d) != DIGEST_SIZE for d in c.rank_digests)
    ):
        return ContributionProblem(
            f"sent {len(c.rank_digests)} covered_digests for {len(covers)} covered ranks; "
            f"give one {DIGEST_SIZE}-byte digest per covered rank, or none",
            ProblemKind.BAD_AGGREGATE,
        )
    n = len(c.terms)
    if len(c.expansions) != n or len(c.zero_ranks) != n:
        return ContributionProblem(
            "sent an aggregated contribution without an expansion and zero count per term",
            ProblemKind.BAD_AGGREGATE,
        )
    # A non-finite component makes the sum non-finite (or NaN), which equals no value.
    sums = tuple(map(_expansion_sum, c.expansions))
    if sums == c.values and max(c.zero_ranks) <= len(covers):
        return None
    for term, value, total, expansion, zeros in zip(
        c.terms, c.values, sums, c.expansions, c.zero_ranks, strict=True
    ):
        if total != value or zeros > len(covers):
            return ContributionProblem(
                f"sent a malformed aggregate for term {term!r}: value {value!r}, expansion "
                f"{list(expansion)} (exact sum {total!r}), zero_ranks {zeros} of "
                f"{len(covers)} ranks; the value must be the finite sum of the expansion",
                ProblemKind.BAD_AGGREGATE,
                (term,),
                (value,),
            )
    raise AssertionError("unreachable: some term failed the check above")
