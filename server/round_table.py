"""The round state machine: pure, synchronous, clock passed in.

A round is one ``(job, group, step)``. Each rank contributes once; the round
ends when every rank has arrived (sums in rank order with ``math.fsum``, then
every global normalizer is checked), when a contribution is invalid or
disagrees with the round's contract (immediately, for every rank, including
ranks that arrive later), at its deadline, or at shutdown. Finished rounds stay
in a bounded per-group cache so a retry gets the identical outcome; a step that
fell out of the cache or behind the retained window is refused as stale rather
than collected twice.

Nothing here knows about gRPC or asyncio: the servicer passes ``now`` in,
schedules each round's deadline itself, and keeps its own per-round state in
:attr:`Round.handle`. The table decides; its parts judge and compute:
:mod:`~lossreduce.contribution_check` and ``validation`` (a contribution alone,
and against its round), ``summation`` (the exact sums), ``records`` (what the
outcome store keeps of a round) and ``step_window`` (a group's rounds and stale
steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lossreduce.contribution import Contribution
from lossreduce.contribution_check import ContributionProblem, check_contribution
from lossreduce.errors import (
    ConflictingContributionError,
    CoordinatorUnavailableError,
    EmptyNormalizerError,
    InvalidPartialError,
    LimitExceededError,
    LossReduceError,
    RoundAbortedError,
    RoundTimeoutError,
    StaleRoundError,
    format_terms,
)
from lossreduce.rules import check_global_normalizer

from .limits import check_contract_lengths, check_group_names
from .outcomes import (
    Outcome,
    OutcomeKind,
    OutcomeStore,
    RejectReason,
    RoundKey,
    RoundObserver,
    RoundRecord,
    TermNormalizerValue,
    key_error,
)
from .records import contribution_digest, record_of, restored_reference
from .settings import CoordinatorSettings
from .step_window import StepWindow
from .summation import distinct, sum_terms
from .validation import contract_mismatch, late_mismatch, reject_reason

__all__ = ["Admission", "Contribution", "Round", "RoundTable"]


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


class RoundTable:
    """Every live and recently finished round of every job and group.

    Not thread-safe: one owner (the servicer's event loop) calls it.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        observer: RoundObserver | None = None,
        store: OutcomeStore | None = None,
    ) -> None:
        self._settings = settings
        self._observer = observer
        self._store = store
        self._jobs: dict[str, dict[str, StepWindow]] = {}
        self._live_count = 0
        self._closing = False

    @property
    def live_count(self) -> int:
        """Rounds still collecting, over every job and group."""
        return self._live_count

    @property
    def closing(self) -> bool:
        return self._closing

    def contribute(self, key: RoundKey, c: Contribution, now: float) -> Admission:
        """Add one rank's contribution; see :class:`Admission` for the answer."""
        groups = self._jobs.get(key.job)
        group = None if groups is None else groups.get(key.group)
        limit_error = self._check_request_limits(key, c, group)
        if limit_error is not None:
            return Admission(None, limit_error)
        rnd = self._find(group, key)
        created = False
        if rnd is None:
            refusal = self._refuse_new_round(group, key)
            if refusal is not None:
                return Admission(None, refusal)
            group = group or self._add_group(key, now)
            rnd = self._open(group, key, c, now)
            created = True
        if group is not None:
            group.last_activity = now

        previous = rnd.contribution_of(c.rank)
        if previous is None and c.covers:
            # An aggregate overlapping ranks that already arrived is a conflict.
            previous = next(filter(None, map(rnd.contribution_of, c.covers)), None)
        if previous is not None:
            if previous == c:
                self._notify_accepted(key, retry=True)
                return Admission(rnd)
            return self._conflict(key, previous, c)
        if rnd.record is not None:
            resent = self._check_resend(rnd, rnd.record, c)
            if resent is not None:
                return resent

        # The first contribution's names were judged when it opened the round.
        invalid = check_contribution(c, known_terms=() if created else rnd.reference.terms)
        if invalid is not None:
            return self._reject_invalid(rnd, c.rank, invalid, now, created)
        if rnd.outcome is not None:
            # A late or restarted rank of a round that already ended gets that ending:
            # a failure is every rank's, whatever it sent. Success is only for a rank
            # that agrees with the round's contract; one that disagrees never counted.
            if rnd.outcome.kind is OutcomeKind.COMPLETED:
                completed = (n.term for n in rnd.outcome.normalizers)
                late = late_mismatch(key, rnd.reference, completed, c)
                if late is not None:
                    return Admission(None, late)
            return Admission(rnd)

        mismatch = contract_mismatch(key, rnd.reference, c)
        if mismatch is not None:
            self._finish(rnd, Outcome(key, OutcomeKind.CONTRACT_MISMATCH, error=mismatch), now)
            return Admission(rnd, created=created, finished=True)

        for rank in c.ranks:
            rnd.contributions[rank] = c
        if self._store is not None:
            self._keep_digest(rnd, c)
        rnd.arrived += len(c.ranks)
        rnd.previous_arrival, rnd.last_arrival = rnd.last_arrival, now
        self._notify_accepted(key, retry=False)
        if rnd.arrived < rnd.world_size:
            return Admission(rnd, created=created)
        self._finish(rnd, self._complete(rnd), now)
        return Admission(rnd, created=created, finished=True)

    def time_out(self, rnd: Round, now: float) -> bool:
        """End ``rnd`` as timed out if it is still collecting; True when it ended now."""
        if rnd.outcome is not None:
            return False
        missing = rnd.missing_ranks()
        key = rnd.key
        err = key_error(
            RoundTimeoutError,
            key,
            f"timed out after {self._settings.round_timeout_s:g} s "
            f"waiting for ranks {missing} ({len(missing)} of {rnd.world_size} missing)",
            ranks=missing,
        )
        self._finish(rnd, Outcome(key, OutcomeKind.ABORTED_TIMEOUT, error=err), now)
        return True

    def expire(self, now: float) -> list[Round]:
        """Time out every round past its deadline and forget idle groups.

        Returns the rounds that ended now. The servicer normally times rounds
        out one by one with :meth:`time_out`; this sweep is the backstop.
        """
        ended = [
            rnd for rnd in self._live_rounds() if rnd.deadline <= now and self.time_out(rnd, now)
        ]
        ttl = self._settings.idle_group_ttl_s
        for job, groups in list(self._jobs.items()):
            for name, group in list(groups.items()):
                if not group.live and now - group.last_activity >= ttl:
                    del groups[name]
                    if self._observer is not None:
                        self._observer.group_forgotten(job, name)
            if not groups:
                del self._jobs[job]
        return ended

    def close(self) -> None:
        """Refuse new rounds from now on; live rounds may still complete."""
        self._closing = True

    def abort_all(self, now: float) -> list[Round]:
        """End every live round as abandoned by a shutting-down coordinator."""
        ended = list(self._live_rounds())
        for rnd in ended:
            missing = rnd.missing_ranks()
            err = key_error(
                CoordinatorUnavailableError,
                rnd.key,
                f"the coordinator shut down before ranks {missing} arrived",
                ranks=missing,
            )
            self._finish(rnd, Outcome(rnd.key, OutcomeKind.ABORTED_SHUTDOWN, error=err), now)
        return ended

    def _live_rounds(self) -> Iterator[Round]:
        # A snapshot: callers finish rounds, which moves them out of ``live``.
        return iter(
            [
                rnd
                for groups in self._jobs.values()
                for g in groups.values()
                for rnd in g.live.values()
            ]
        )

    def lookup(self, key: RoundKey) -> Round | None:
        """The live or cached round ``key``, or None."""
        return self._find(self._jobs.get(key.job, {}).get(key.group), key, use_store=False)

    def rounds(self, job: str = "") -> list[Round]:
        """Live then recently finished rounds of ``job`` (every job when empty)."""
        jobs = [self._jobs.get(job, {})] if job else list(self._jobs.values())
        return [
            rnd
            for groups in jobs
            for group in groups.values()
            for rnd in (*group.live.values(), *reversed(group.finished.values()))
        ]

    # -- internals --------------------------------------------------------------

    def _check_request_limits(
        self, key: RoundKey, c: Contribution, group: StepWindow | None
    ) -> LossReduceError | None:
        s = self._settings
        if group is None:
            # A group's job and group names were judged when it was opened.
            named = check_group_names(key, c.rank, max_name_length=s.max_name_length)
            if named is not None:
                return named
        if group is None or c.contracts != group.judged_contracts:
            long_contract = check_contract_lengths(
                key, c.rank, c.terms, c.contracts, max_contract_length=s.max_contract_length
            )
            if long_contract is not None:
                return long_contract
            if group is not None:
                group.judged_contracts = c.contracts
        for name, value, limit in (
            ("max_terms", len(c.terms), s.max_terms),
            ("max_world_size", c.world_size, s.max_world_size),
        ):
            if value > limit:
                return self._limit(key, c.rank, name, f"{name.removeprefix('max_')} {value}", limit)
        if c.world_size == 0:
            return key_error(
                InvalidPartialError,
                key,
                f"rank {c.rank} sent world_size 0",
                rank=c.rank,
                ranks=(c.rank,),
            )
        return None

    @staticmethod
    def _limit(
        key: RoundKey, rank: int | None, name: str, what: str, limit: int
    ) -> LimitExceededError:
        return key_error(
            LimitExceededError,
            key,
            f"{what} exceeds the coordinator limit {name}={limit}",
            rank=rank,
            limit=name,
        )

    def _find(
        self, group: StepWindow | None, key: RoundKey, *, use_store: bool = True
    ) -> Round | None:
        if group is not None:
            rnd = group.live.get(key.step) or group.finished.get(key.step)
            if rnd is not None:
                return rnd
        if use_store and self._store is not None:
            outcome = self._store.get(key)
            if outcome is not None:
                return _restored(outcome)
        return None

    def _refuse_new_round(self, group: StepWindow | None, key: RoundKey) -> LossReduceError | None:
        s = self._settings
        if self._closing:
            return key_error(
                CoordinatorUnavailableError,
                key,
                "the coordinator is shutting down and opens no new rounds",
            )
        if group is None:
            groups = self._jobs.get(key.job)
            if groups is None and len(self._jobs) >= s.max_jobs:
                return self._limit(key, None, "max_jobs", f"job {len(self._jobs) + 1}", s.max_jobs)
            if groups is not None and len(groups) >= s.max_groups_per_job:
                return self._limit(
                    key,
                    None,
                    "max_groups_per_job",
                    f"group {len(groups) + 1}",
                    s.max_groups_per_job,
                )
            return None
        floor = group.is_stale(key.step, s)
        if floor is not None:
            return key_error(
                StaleRoundError,
                key,
                f"step is stale; the newest step of the group is "
                f"{group.newest_step} and steps up to {floor} are no longer retained "
                f"(retained_steps={s.retained_steps}, finished_cache_size={s.finished_cache_size})",
                limit="retained_steps",
            )
        if len(group.live) >= s.max_rounds_in_flight:
            return self._limit(
                key,
                None,
                "max_rounds_in_flight",
                f"round {len(group.live) + 1} in flight",
                s.max_rounds_in_flight,
            )
        return None

    def _add_group(self, key: RoundKey, now: float) -> StepWindow:
        group = StepWindow(now)
        self._jobs.setdefault(key.job, {})[key.group] = group
        return group

    def _open(self, group: StepWindow, key: RoundKey, c: Contribution, now: float) -> Round:
        rnd = Round(key, c, now, self._settings.round_timeout_s)
        group.live[key.step] = rnd
        group.newest_step = max(group.newest_step, key.step)
        self._live_count += 1
        if self._observer is not None:
            self._observer.round_started(key)
        return rnd

    def _notify_accepted(self, key: RoundKey, *, retry: bool) -> None:
        if self._observer is not None:
            self._observer.contribution_accepted(key, retry=retry)

    def _notify_rejected(self, key: RoundKey, reason: RejectReason) -> None:
        if self._observer is not None:
            self._observer.contribution_rejected(key, reason)

    def _conflict(self, key: RoundKey, previous: Contribution, c: Contribution) -> Admission:
        self._notify_rejected(key, RejectReason.CONFLICTING)
        before = format_terms(previous.terms, previous.values)
        after = format_terms(c.terms, c.values)
        err = key_error(
            ConflictingContributionError,
            key,
            f"rank {c.rank} already contributed {before} "
            f"(world_size {previous.world_size}) and now sent {after} (world_size {c.world_size}); "
            "the round keeps the first contribution",
            rank=c.rank,
            terms=c.terms,
            values=c.values,
            ranks=(c.rank,),
        )
        return Admission(None, err)

    def _check_resend(self, rnd: Round, record: RoundRecord, c: Contribution) -> Admission | None:
        """A rank of a round rebuilt from the store re-sending: the stored outcome when its
        contribution is the one the round counted, a conflict when it differs, None when
        the round never counted anything from its ranks."""
        stored = next(filter(None, map(record.digest_of, c.ranks)), None)
        if stored is None:
            return None
        if stored == contribution_digest(c):
            self._notify_accepted(rnd.key, retry=True)
            return Admission(rnd)
        self._notify_rejected(rnd.key, RejectReason.CONFLICTING)
        err = key_error(
            ConflictingContributionError,
            rnd.key,
            f"rank {c.rank} already contributed other partials to this round before the "
            f"coordinator restarted and now sent {format_terms(c.terms, c.values)} "
            f"(world_size {c.world_size}); the round keeps the first contribution",
            rank=c.rank,
            terms=c.terms,
            values=c.values,
            ranks=(c.rank,),
        )
        return Admission(None, err)

    @staticmethod
    def _keep_digest(rnd: Round, c: Contribution) -> None:
        if not rnd.digests:
            rnd.digests = [None] * rnd.world_size
        digest = contribution_digest(c)
        for rank in c.ranks:
            rnd.digests[rank] = digest

    def _reject_invalid(
        self, rnd: Round, rank: int, invalid: ContributionProblem, now: float, created: bool
    ) -> Admission:
        key = rnd.key
        culprit = key_error(
            InvalidPartialError,
            key,
            f"rank {rank} {invalid.detail}",
            rank=rank,
            terms=invalid.terms,
            values=invalid.values,
            ranks=(rank,),
        )
        outcome = rnd.outcome
        if outcome is not None:
            if outcome.culprit is not None and outcome.culprit.rank == rank:
                return Admission(rnd)  # the culprit retrying gets its own answer again
            self._notify_rejected(key, reject_reason(invalid))
            return Admission(None, culprit)
        self._notify_rejected(key, reject_reason(invalid))
        aborted = key_error(
            RoundAbortedError,
            key,
            f"aborted because rank {rank} {invalid.detail}",
            terms=invalid.terms,
            values=invalid.values,
            ranks=(rank,),
        )
        outcome = Outcome(key, OutcomeKind.ABORTED_INVALID, error=aborted, culprit=culprit)
        self._finish(rnd, outcome, now)
        return Admission(rnd, created=created, finished=True)

    def _complete(self, rnd: Round) -> Outcome:
        key = rnd.key
        normalizers = sum_terms(rnd.reference.terms, distinct(rnd.contributions))
        bad = [n for n in normalizers if check_global_normalizer(n.value) is not None]
        if not bad:
            return Outcome(key, OutcomeKind.COMPLETED, normalizers=normalizers)
        terms = tuple(n.term for n in bad)
        values = tuple(n.value for n in bad)
        err = key_error(
            EmptyNormalizerError,
            key,
            f"global normalizer {format_terms(terms, values)} is not "
            "finite and > 0; no rank may run backward for this step",
            terms=terms,
            values=values,
        )
        return Outcome(key, OutcomeKind.REJECTED_EMPTY, error=err)

    def _finish(self, rnd: Round, outcome: Outcome, now: float) -> None:
        assert rnd.outcome is None, f"round {rnd.key} finished twice"
        if self._store is not None and outcome.kind is not OutcomeKind.ABORTED_SHUTDOWN:
            # Durable before any rank can see it (a restarted coordinator answers retries from it).
            outcome = dataclasses.replace(
                outcome,
                record=record_of(rnd.reference, rnd.digests or [None] * rnd.world_size),
            )
            self._store.put(outcome)
        rnd.outcome = outcome
        rnd.finished_at = now
        self._jobs[rnd.key.job][rnd.key.group].retire(rnd, self._settings)
        self._live_count -= 1
        if self._observer is not None:
            previous, last = rnd.previous_arrival, rnd.last_arrival
            wait = None if previous is None or last is None else last - previous
            self._observer.round_finished(
                rnd.key, outcome, duration_s=now - rnd.created_at, straggler_wait_s=wait
            )


def _restored(outcome: Outcome) -> Round:
    """A finished round rebuilt from the outcome store.

    Its contributions are not kept, only its contract and one digest per arrived rank
    (``outcome.record``; None in journals written before records existed).
    """
    rnd = Round(outcome.key, restored_reference(outcome.record), 0.0, 0.0)
    rnd.outcome = outcome
    rnd.record = outcome.record
    rnd.finished_at = 0.0
    return rnd
