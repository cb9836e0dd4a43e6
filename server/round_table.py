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
and against its round), ``refusals`` (limits, shutdown, stale steps, another
run's claim), ``resends`` (re-sent ranks, however grouped), ``run_claims``
(which run holds each group), ``summation`` (the exact sums), ``records``
(what the outcome store keeps of a round),
``step_window`` (a group's rounds and stale steps) and ``rounds`` (a round and
an admission).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from lossreduce.contribution import Contribution, own_digests
from lossreduce.contribution_check import ContributionProblem, check_contribution
from lossreduce.errors import (
    ConflictingContributionError,
    CoordinatorUnavailableError,
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    RoundAbortedError,
    RoundTimeoutError,
    format_terms,
)
from lossreduce.rules import check_global_normalizer

from .outcomes import (
    Outcome,
    OutcomeKind,
    OutcomeStore,
    RejectReason,
    RoundKey,
    RoundObserver,
    key_error,
)
from .records import record_of
from .refusals import (
    claim_limit_error,
    new_round_refusal,
    request_limit_error,
    run_conflict_error,
)
from .resends import Resend, ResendKind, judge_resend
from .rounds import Admission, Round, restored_round
from .run_claims import Claim, ClaimStore, RunClaims
from .settings import CoordinatorSettings
from .step_window import StepWindow
from .summation import distinct, sum_terms
from .validation import contract_mismatch, late_mismatch, reject_reason

__all__ = ["Admission", "Contribution", "Round", "RoundTable"]


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
        claim_store: ClaimStore | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._observer = observer
        self._store = store
        self._wall_clock = wall_clock
        self._claims = RunClaims()
        # A journal keeps the runs holding groups, so a restart still refuses a collision.
        self._claim_store = claim_store
        if self._claim_store is not None:
            self._claims.restore(self._claim_store.claims())
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
        limit_error = request_limit_error(self._settings, key, c, group)
        if limit_error is not None:
            return Admission(None, limit_error)
        if c.run:
            # Before the round is even looked at: another run's contribution must
            # neither join this run's rounds nor receive their answers.
            refused = self._claim(key, c.run, c.rank, now)
            if refused is not None:
                return Admission(None, refused)
        rnd = self._find(group, key)
        created = False
        if rnd is None:
            groups = self._jobs.get(key.job)
            refusal = new_round_refusal(
                self._settings,
                key,
                group,
                closing=self._closing,
                jobs=len(self._jobs),
                groups_of_job=None if groups is None else len(groups),
            )
            if refusal is not None:
                return Admission(None, refusal)
            group = group or self._add_group(key, now)
            rnd = self._open(group, key, c, now)
            created = True
        if group is not None:
            group.last_activity = now

        previous = rnd.contribution_of(c.rank)
        if previous is None and c.covers:
            # An aggregate overlapping ranks that already arrived: judged rank by rank.
            previous = next(filter(None, map(rnd.contribution_of, c.covers)), None)
        if previous is not None:
            if previous == c:  # the common retry: the identical request again
                self._notify_accepted(key, retry=True)
                return Admission(rnd)
            return self._resend(rnd, c, judge_resend(c, rnd.counted_digest))
        if rnd.record is not None:
            verdict = judge_resend(c, rnd.record.digest_of)
            if verdict.kind is not ResendKind.NEW:
                return self._resend(rnd, c, verdict)

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
                    self._drop_claim(job, name)
                    if self._observer is not None:
                        self._observer.group_forgotten(job, name)
            if not groups:
                del self._jobs[job]
        live = {(job, name) for job, groups in self._jobs.items() for name in groups}
        for job, name in self._claims.expire(now, ttl, groups=live):
            # A claim whose group never opened (its first round was refused).
            self._drop_claim(job, name)
            if self._observer is not None:
                self._observer.group_forgotten(job, name)
        return ended

    def claim(self, key: RoundKey, run: str, rank: int, now: float) -> LossReduceError | None:
        """Claim ``key``'s job and group for ``run`` before its first round (``key.step``
        is the first step it will send): None when admitted, the refusal otherwise.

        The rules are a contribution's (:mod:`lossreduce.server.run_claims`), and so
        are the refusal and the metrics; nothing else about the group changes."""
        refused = claim_limit_error(self._settings, key, rank, run)
        if refused is not None:
            return refused
        return self._claim(key, run, rank, now)

    def holder(self, job: str, group: str) -> Claim | None:
        """The run holding ``(job, group)``, or None."""
        return self._claims.holder(job, group)

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
                return restored_round(outcome)
        return None

    def _claim(self, key: RoundKey, run: str, rank: int, now: float) -> LossReduceError | None:
        wall = self._wall_clock()
        verdict = self._claims.admit(key.job, key.group, run, key.step, now=now, wall=wall)
        changed, self._claims.changed = self._claims.changed, []
        if self._claim_store is not None:
            for record in changed:
                self._claim_store.put_claim(record)
        if self._observer is not None:
            for record in changed:
                self._observer.run_claimed(record)
        if verdict is None:
            return None
        self._notify_rejected(key, RejectReason.RUN_CONFLICT)
        return run_conflict_error(self._settings, key, rank, verdict, wall=wall)

    def _drop_claim(self, job: str, group: str) -> None:
        if self._claims.forget(job, group) and self._claim_store is not None:
            self._claim_store.drop_claim(job, group)

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

    def _resend(self, rnd: Round, c: Contribution, verdict: Resend) -> Admission:
        """Answer a contribution re-sending ranks the round already counted."""
        key = rnd.key
        if verdict.kind is ResendKind.RETRY:
            self._notify_accepted(key, retry=True)
            return Admission(rnd)
        self._notify_rejected(key, RejectReason.CONFLICTING)
        after = format_terms(c.terms, c.values)
        if verdict.kind is ResendKind.MIXED:
            message = (
                f"an aggregate of ranks {list(c.ranks)} re-sends ranks {list(verdict.counted)}, "
                f"already counted, together with ranks {list(verdict.new)}, not counted yet; "
                "a node sends such ranks alone"
            )
            rank, ranks = c.rank, verdict.new
        else:
            assert verdict.rank is not None  # CHANGED names the rank
            rank, ranks = verdict.rank, (verdict.rank,)
            previous = rnd.contribution_of(rank)
            sent = f"now sent {after} (world_size {c.world_size})"
            if c.covers:
                sent = f"now, in an aggregate of ranks {list(c.ranks)}, sent other partials"
            if previous is None:
                before = "other partials to this round before the coordinator restarted"
            elif previous.covers:
                before = (
                    f"other partials, counted in the aggregate of ranks {list(previous.ranks)} "
                    f"({format_terms(previous.terms, previous.values)})"
                )
            else:
                before = (
                    f"{format_terms(previous.terms, previous.values)} "
                    f"(world_size {previous.world_size})"
                )
            message = (
                f"rank {rank} already contributed {before} and {sent}; "
                "the round keeps the first contribution"
            )
        err = key_error(
            ConflictingContributionError,
            key,
            message,
            rank=rank,
            terms=c.terms,
            values=c.values,
            ranks=ranks,
        )
        return Admission(None, err)

    @staticmethod
    def _keep_digest(rnd: Round, c: Contribution) -> None:
        if not rnd.digests:
            rnd.digests = [None] * rnd.world_size
        for rank, digest in own_digests(c).items():
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
