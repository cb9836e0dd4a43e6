"""A round as the round table keeps it, and what the table answers one contribution.

:class:`Round` is one live or finished ``(job, group, step)``: its reference
contribution (world size, terms, contracts), the contributions that arrived,
and once it ended its :class:`~lossreduce.server.outcomes.Outcome`.
:class:`Admission` is what :meth:`~lossreduce.server.RoundTable.contribute`
did with one contribution. Only the table changes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lossreduce.contribution import Contribution, own_digests
from lossreduce.errors import LossReduceError

from .outcomes import Outcome, OutcomeKind, RoundKey, RoundRecord, TermNormalizerValue
from .records import restored_reference
from .summation import distinct, sum_terms

__all__ = ["Admission", "Round", "restored_round"]


class Round:
    """A live or finished round. Read-only outside the table except :attr:`handle`."""

    __slots__ = (
        "arrived",
        "contributions",
        "created_at",
        "deadline",
        "digests",
        "finished_at",
        "handle",
        "key",
        "last_arrival",
        "outcome",
        "previous_arrival",
        "record",
        "reference",
    )

    def __init__(
        self, key: RoundKey, reference: Contribution, now: float, timeout_s: float
    ) -> None:
        self.key = key
        # The first contribution fixes world size, term names and contracts for the round.
        self.reference = reference
        # Indexed by rank; the world size is bounded by max_world_size before a round opens.
        self.contributions: list[Contribution | None] = [None] * reference.world_size
        self.digests: list[bytes | None] = []
        """With an outcome store: per rank, the digest of the contribution that counted,
        taken as it arrived so the last arrival does not hash the whole round."""
        self.arrived = 0
        self.created_at = now
        self.deadline = now + timeout_s
        self.last_arrival: float | None = None
        self.previous_arrival: float | None = None
        self.finished_at: float | None = None
        self.outcome: Outcome | None = None
        self.handle: Any = None
        """Free for the adapter driving the table (the servicer's waiters and timer)."""
        self.record: RoundRecord | None = None
        """A round rebuilt from the outcome store: what it kept of its contributions."""

    @property
    def world_size(self) -> int:
        return self.reference.world_size

    def contribution_of(self, rank: int) -> Contribution | None:
        return self.contributions[rank] if rank < len(self.contributions) else None

    def counted_digest(self, rank: int) -> bytes | None:
        """The digest of ``rank``'s own contribution as the round counted it (None: not yet)."""
        c = self.contribution_of(rank)
        return None if c is None else own_digests(c)[rank]

    def arrived_ranks(self) -> list[int]:
        return [r for r, c in enumerate(self.contributions) if c is not None]

    def missing_ranks(self) -> list[int]:
        if self.outcome is not None and self.outcome.kind is OutcomeKind.COMPLETED:
            return []
        return [r for r, c in enumerate(self.contributions) if c is None]

    def partial_sums(self) -> tuple[TermNormalizerValue, ...]:
        """Per-term exact sums of what has arrived (the normalizers once completed)."""
        if self.outcome is not None and self.outcome.kind is OutcomeKind.COMPLETED:
            return self.outcome.normalizers
        return sum_terms(self.reference.terms, distinct(self.contributions))


@dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`RoundTable.contribute` did with one contribution.

    ``error`` is this request's own answer when it was refused (the round, if
    any, is unaffected). Otherwise the answer is ``round.outcome`` once the
    round has one (``Outcome.error_for(rank)``). ``created`` says a new round
    was opened (schedule its deadline); ``finished`` that this contribution
    ended it (wake its waiters).
    """

    round: Round | None
    error: LossReduceError | None = None
    created: bool = False
    finished: bool = False


def restored_round(outcome: Outcome) -> Round:
    """A finished round rebuilt from the outcome store.

    Its contributions are not kept, only its contract and one digest per arrived rank
    (``outcome.record``; None in journals written before records existed).
    """
    rnd = Round(outcome.key, restored_reference(outcome.record), 0.0, 0.0)
    rnd.outcome = outcome
    rnd.record = outcome.record
    rnd.finished_at = 0.0
    return rnd
