"""Which run holds each ``(job, group)``: pure, synchronous, clocks passed in.

One coordinator serves many jobs. Two launches that name the same job and
group (a second run of one script, two users keeping a default job name) would
otherwise meet in the same rounds: the second run's first contribution then
conflicts with the first run's, or silently receives its cached answer. So a
run *claims* a ``(job, group)`` with its first contribution, and a different
run is refused (:class:`~lossreduce.errors.RunConflictError`) before its
contribution touches any round, on every one of its ranks, while the claim
stands.

The rules, in order:

- An empty run (a client from before runs existed) is never checked and claims
  nothing: it behaves exactly as before.
- No claim: the run claims the group.
- The holder itself: admitted (a retry of the same run gets its identical
  answer from the round table, as ever).
- A run the group's holder replaced: refused, saying it was replaced.
- Another run whose step is past the newest step the holder ever contributed:
  a run resumed from a checkpoint continuing at its global step. It takes the
  claim over; the old holder is remembered as replaced.
- Another run at or below that step: a collision, refused.

A claim lives as long as its group: the round table drops it when it forgets
the idle group (``idle_group_ttl_s``). A claim whose group never opened (its
first round was refused) goes after the same idle time. The journal keeps
claims across a restart (:class:`ClaimRecord`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "MAX_REPLACED_RUNS",
    "Claim",
    "ClaimRecord",
    "ClaimStore",
    "ClaimVerdict",
    "RunClaims",
]

MAX_REPLACED_RUNS = 8
"""Replaced runs remembered per group (oldest forgotten first), so a group's
history stays bounded however often it is resumed."""


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """What the journal keeps of one claim: enough to refuse a collision after a restart."""

    job: str
    group: str
    run: str
    since: float
    """When the run claimed the group (Unix seconds)."""
    newest_step: int
    """The newest step the run contributed when the record was written."""


@dataclass(slots=True)
class Claim:
    """One group's holder."""

    run: str
    since: float
    """When ``run`` claimed the group (Unix seconds, for messages)."""
    newest_step: int
    """The newest step ``run`` contributed: a different run must start past it."""
    last_seen: float | None
    """The table's clock at the holder's last contribution; None for a claim restored
    from the journal until the table's next sweep starts its idle time."""
    replaced: OrderedDict[str, tuple[str, float]]
    """Runs this group's claim was taken from: run -> (the run that took it, when)."""


@dataclass(frozen=True, slots=True)
class ClaimVerdict:
    """A refusal: ``run`` may not contribute to the group ``holder`` holds since ``since``."""

    run: str
    holder: str
    since: float
    newest_step: int
    replaced: bool
    """``run`` held the group until ``holder`` (a resumed run) took it over."""


class RunClaims:
    """Every ``(job, group)``'s holder. Not thread-safe: the round table's owner calls it."""

    def __init__(self) -> None:
        self._claims: dict[tuple[str, str], Claim] = {}
        self.changed: list[ClaimRecord] = []
        """Claims made or taken over since the owner last emptied it (to journal them)."""

    def __len__(self) -> int:
        return len(self._claims)

    def holder(self, job: str, group: str) -> Claim | None:
        """The group's claim, or None when no run holds it."""
        return self._claims.get((job, group))

    def admit(
        self, job: str, group: str, run: str, step: int, *, now: float, wall: float
    ) -> ClaimVerdict | None:
        """None when ``run`` may contribute ``step`` to the group (claiming it if
        free or taking it over as a resumed run); the refusal otherwise.

        ``now`` is the table's clock (idle expiry), ``wall`` Unix seconds (messages).
        """
        if not run:
            return None
        key = (job, group)
        claim = self._claims.get(key)
        if claim is None:
            self._claims[key] = Claim(run, wall, step, now, OrderedDict())
            self.changed.append(ClaimRecord(job, group, run, wall, step))
            return None
        if claim.run == run:
            claim.last_seen = now
            claim.newest_step = max(claim.newest_step, step)
            return None
        taken = claim.replaced.get(run)
        if taken is not None:
            return ClaimVerdict(run, claim.run, claim.since, claim.newest_step, replaced=True)
        if step <= claim.newest_step:
            return ClaimVerdict(run, claim.run, claim.since, claim.newest_step, replaced=False)
        claim.replaced[claim.run] = (run, wall)
        while len(claim.replaced) > MAX_REPLACED_RUNS:
            claim.replaced.popitem(last=False)
        claim.replaced.pop(run, None)
        claim.run, claim.since, claim.newest_step, claim.last_seen = run, wall, step, now
        self.changed.append(ClaimRecord(job, group, run, wall, step))
        return None

    def forget(self, job: str, group: str) -> bool:
        """Drop the group's claim (its group went idle); True when there was one."""
        return self._claims.pop((job, group), None) is not None

    def expire(
        self, now: float, ttl: float, *, groups: set[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        """Drop the claims idle for ``ttl`` whose group is not in ``groups`` (the known
        ones; a claim of a known group goes with its group instead). Returns their keys."""
        gone = []
        for key, claim in self._claims.items():
            if claim.last_seen is None:
                claim.last_seen = now
            elif key not in groups and now - claim.last_seen >= ttl:
                gone.append(key)
        for key in gone:
            del self._claims[key]
        return gone

    def restore(self, records: list[ClaimRecord]) -> None:
        """Claims read back from the journal after a restart (idle from the next sweep)."""
        for r in records:
            self._claims[(r.job, r.group)] = Claim(
                r.run, r.since, r.newest_step, None, OrderedDict()
            )

    def records(self) -> list[ClaimRecord]:
        """Every claim as the journal keeps it."""
        return [
            ClaimRecord(job, group, c.run, c.since, c.newest_step)
            for (job, group), c in self._claims.items()
        ]


class ClaimStore(Protocol):
    """Where claims outlive the process (the journal's
    :class:`~lossreduce.server.JournalOutcomeStore`), so a restarted coordinator
    knows which run holds each group."""

    def put_claim(self, record: ClaimRecord) -> None:
        """Keep ``record`` as its group's claim (replacing the group's previous one)."""

    def drop_claim(self, job: str, group: str) -> None:
        """Forget the group's claim (it expired with its group)."""

    def claims(self) -> list[ClaimRecord]:
        """Every kept claim (read once, at start)."""
