"""What a finished round answers, and the seams around the round table.

A round ends in exactly one :class:`Outcome`, which every rank receives (only
the culprit of an invalid contribution gets its own ``INVALID_ARGUMENT``). The
two protocols here are how adapters plug into the pure table without it
knowing about them: a :class:`RoundObserver` (metrics) hears about every
contribution and every finished round, and an :class:`OutcomeStore` (a later
journal) persists outcomes before any rank can see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

from lossreduce._compat import StrEnum
from lossreduce.contribution import DIGEST_SIZE
from lossreduce.errors import InvalidPartialError, LossReduceError, round_error

if TYPE_CHECKING:
    from .run_claims import ClaimRecord

__all__ = [
    "DIGEST_SIZE",
    "Outcome",
    "OutcomeKind",
    "OutcomeStore",
    "RejectReason",
    "RoundKey",
    "RoundObserver",
    "RoundRecord",
    "TermNormalizerValue",
    "key_error",
]


class RoundKey(NamedTuple):
    """One round: ``(job, group, step)``; rounds of different jobs or groups never interact."""

    job: str
    group: str
    step: int


_E = TypeVar("_E", bound=LossReduceError)


def key_error(
    cls: type[_E],
    key: RoundKey,
    detail: str,
    *,
    rank: int | None = None,
    terms: tuple[str, ...] = (),
    values: tuple[float, ...] = (),
    ranks: Sequence[int] = (),
    limit: str = "",
) -> _E:
    """An error about round ``key``: its message starts by naming job, group and step."""
    return round_error(
        cls,
        detail,
        job=key.job,
        group=key.group,
        step=key.step,
        rank=rank,
        terms=terms,
        values=values,
        ranks=ranks,
        limit=limit,
    )


class OutcomeKind(StrEnum):
    """How a round ended (the ``outcome`` label of ``lossreduce_rounds_total``)."""

    COMPLETED = "completed"
    REJECTED_EMPTY = "rejected_empty"
    ABORTED_INVALID = "aborted_invalid"
    ABORTED_TIMEOUT = "aborted_timeout"
    CONTRACT_MISMATCH = "contract_mismatch"
    ABORTED_SHUTDOWN = "aborted_shutdown"


class RejectReason(StrEnum):
    """Why one contribution was refused (the ``reason`` label of
    ``lossreduce_rejected_partials_total``)."""

    NAN = "nan"
    INFINITE = "infinite"
    NEGATIVE = "negative"
    RANK_OUT_OF_RANGE = "rank_out_of_range"
    DUPLICATE_TERM = "duplicate_term"
    BAD_TERM_NAME = "bad_term_name"
    CONFLICTING = "conflicting"
    BAD_AGGREGATE = "bad_aggregate"
    RUN_CONFLICT = "run_conflict"
    """Another run holds the group (:class:`~lossreduce.errors.RunConflictError`)."""


class TermNormalizerValue(NamedTuple):
    """One term's global normalizer and how many ranks sent 0 for it."""

    term: str
    value: float
    zero_ranks: int


class RoundRecord(NamedTuple):
    """What a finished round keeps of its contributions for a coordinator restarted on its
    journal: enough to tell a rank's identical re-send from a conflicting one, and a
    contribution that disagrees with the round's contract."""

    reference_rank: int
    """The rank whose contribution opened the round and fixed its contract."""
    world_size: int
    terms: tuple[str, ...]
    """In the reference rank's order (the order of ``Outcome.normalizers``)."""
    contracts: tuple[str, ...]
    digests: bytes
    """``DIGEST_SIZE`` bytes per rank, in rank order: the digest of the contribution that
    counted for that rank, all zeros for a rank that did not arrive."""

    def digest_of(self, rank: int) -> bytes | None:
        """The digest of what ``rank`` contributed, or None when it did not arrive."""
        if not 0 <= rank < self.world_size:
            return None
        digest = self.digests[rank * DIGEST_SIZE : (rank + 1) * DIGEST_SIZE]
        return digest if any(digest) else None


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer of a finished round, identical for every rank.

    ``normalizers`` is in the term order of the round's first contribution and
    empty unless ``kind`` is COMPLETED; ``error`` is what every rank receives
    otherwise. ``culprit`` is the error for the one rank whose invalid
    contribution aborted the round (``error`` then names that rank too).
    """

    key: RoundKey
    kind: OutcomeKind
    normalizers: tuple[TermNormalizerValue, ...] = ()
    error: LossReduceError | None = None
    culprit: InvalidPartialError | None = None
    record: RoundRecord | None = field(default=None, compare=False)
    """Set on outcomes handed to an :class:`OutcomeStore`: the round's contract and one
    digest per arrived rank, so a restarted coordinator can check re-sends."""

    def error_for(self, rank: int) -> LossReduceError | None:
        """The error ``rank`` receives, or None when the round completed."""
        if self.culprit is not None and self.culprit.rank == rank:
            return self.culprit
        return self.error


class RoundObserver(Protocol):
    """Hears what the round table does; the metrics adapter implements it.

    Calls happen synchronously inside the table's methods, so an observer must
    be cheap and must not call back into the table.
    """

    def round_started(self, key: RoundKey) -> None:
        """A new round was opened by its first contribution."""

    def contribution_accepted(self, key: RoundKey, *, retry: bool) -> None:
        """A contribution was accepted; ``retry`` when it repeated an identical one."""

    def contribution_rejected(self, key: RoundKey, reason: RejectReason) -> None:
        """A contribution was refused for ``reason``."""

    def round_finished(
        self, key: RoundKey, outcome: Outcome, *, duration_s: float, straggler_wait_s: float | None
    ) -> None:
        """A round ended; ``duration_s`` from first arrival, ``straggler_wait_s``
        between the last two arrivals (None when fewer than two ranks arrived)."""

    def run_claimed(self, record: ClaimRecord) -> None:
        """``record.run`` claimed its group, first or taking it over from a replaced run."""

    def group_forgotten(self, job: str, group: str) -> None:
        """The table forgot an idle group: no round of it is live or cached any more
        (a later contribution starts it afresh)."""


class OutcomeStore(Protocol):
    """Where finished outcomes outlive the in-memory cache (e.g. a journal).

    ``put`` is called before any rank can receive the outcome; ``get`` answers
    a retried contribution whose round is no longer in memory.
    """

    def put(self, outcome: Outcome) -> None:
        """Persist ``outcome``; must return only once it is durable."""

    def get(self, key: RoundKey) -> Outcome | None:
        """The stored outcome of ``key``, or None."""
