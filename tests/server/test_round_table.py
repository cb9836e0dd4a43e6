"""The round table alone: one test per row of the outcome table, plus its edges.

Expected values come from the contract (math.fsum in rank order), not from the
table's code.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from lossreduce.errors import (
    ConflictingContributionError,
    ContractMismatchError,
    CoordinatorUnavailableError,
    EmptyNormalizerError,
    InvalidPartialError,
    LimitExceededError,
    LossReduceError,
    RoundAbortedError,
    RoundTimeoutError,
    StaleRoundError,
)
from lossreduce.server import (
    Admission,
    Contribution,
    CoordinatorSettings,
    Outcome,
    OutcomeKind,
    RejectReason,
    RoundKey,
    RoundTable,
)
from lossreduce.server.run_claims import ClaimRecord

KEY = RoundKey("job-a", "actor", 7)


def contribution(
    rank: int, world_size: int, contracts: dict[str, str] | None = None, **terms: float
) -> Contribution:
    names = tuple(terms)
    return Contribution(
        rank=rank,
        world_size=world_size,
        terms=names,
        values=tuple(terms.values()),
        contracts=tuple((contracts or {}).get(t, f"mean:{t}") for t in names),
    )


def answer(admission: Admission, rank: int) -> LossReduceError | Outcome | None:
    """What the rank is told: its own error, the round's outcome, or None (still waiting)."""
    if admission.error is not None:
        return admission.error
    assert admission.round is not None
    outcome = admission.round.outcome
    if outcome is None:
        return None
    err = outcome.error_for(rank)
    return err if err is not None else outcome


class Recorder:
    """A RoundObserver that remembers every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def round_started(self, key: RoundKey) -> None:
        self.calls.append(("started", key))

    def contribution_accepted(self, key: RoundKey, *, retry: bool) -> None:
        self.calls.append(("retry" if retry else "accepted", key))

    def contribution_rejected(self, key: RoundKey, reason: RejectReason) -> None:
        self.calls.append(("rejected", key, reason))

    def round_finished(
        self, key: RoundKey, outcome: Outcome, *, duration_s: float, straggler_wait_s: float | None
    ) -> None:
        self.calls.append(("finished", key, outcome.kind, duration_s, straggler_wait_s))

    def run_claimed(self, record: ClaimRecord) -> None:
        self.calls.append(("claimed", record.job, record.group, record.run))

    def group_forgotten(self, job: str, group: str) -> None:
        self.calls.append(("forgotten", job, group))

    def count(self, name: str) -> int:
        return sum(1 for call in self.calls if call[0] == name)


def make_table(**overrides: Any) -> tuple[RoundTable, Recorder]:
    settings = CoordinatorSettings.model_validate({"round_timeout_s": 10.0, **overrides})
    recorder = Recorder()
    return RoundTable(settings, observer=recorder), recorder


def test_all_ranks_arrived_completes_with_exact_sums_for_every_rank() -> None:
    table, recorder = make_table()
    values = {0: (1e16, 3.0), 1: (1.0, 0.0), 2: (1.0, 5.0)}
    admissions = {}
    for now, rank in enumerate((2, 0, 1)):
        tok, seq = values[rank]
        admissions[rank] = table.contribute(
            KEY, contribution(rank, 3, tok=tok, seq=seq), float(now)
        )
    assert admissions[2].created
    assert not admissions[0].created
    assert admissions[1].finished
    for rank, admission in admissions.items():
        outcome = answer(admission, rank)
        assert isinstance(outcome, Outcome)
        assert outcome.kind is OutcomeKind.COMPLETED
        # Reference order is the first arrival's (rank 2): tok, seq.
        assert [n.term for n in outcome.normalizers] == ["tok", "seq"]
        tok_sum, seq_sum = outcome.normalizers
        assert tok_sum.value == math.fsum([1e16, 1.0, 1.0]) != 1e16 + 1.0 + 1.0
        assert (seq_sum.value, seq_sum.zero_ranks, tok_sum.zero_ranks) == (8.0, 1, 0)
    assert recorder.count("accepted") == 3
    finished = [c for c in recorder.calls if c[0] == "finished"]
    assert finished == [("finished", KEY, OutcomeKind.COMPLETED, 2.0, 1.0)]
    assert table.live_count == 0


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_sum_is_bit_identical_whatever_the_arrival_order(order: tuple[int, ...]) -> None:
    table, _ = make_table()
    partials = [0.1, 1e-300, 7e15 + 1.0, 3.3333333333333335]
    admission = None
    for rank in order:
        admission = table.contribute(KEY, contribution(rank, 4, tok=partials[rank]), 0.0)
    assert admission is not None
    outcome = answer(admission, order[-1])
    assert isinstance(outcome, Outcome)
    assert outcome.normalizers[0].value.hex() == math.fsum(partials).hex()


def test_zero_global_normalizer_is_rejected_for_every_rank_naming_terms() -> None:
    table, _ = make_table()
    first = table.contribute(KEY, contribution(0, 2, tok=0.0, seq=1.0, grp=0.0), 0.0)
    last = table.contribute(KEY, contribution(1, 2, tok=0.0, seq=2.0, grp=0.0), 1.0)
    errors = [answer(first, 0), answer(last, 1)]
    assert errors[0] is errors[1]  # one error object for the whole round
    err = errors[0]
    assert isinstance(err, EmptyNormalizerError)
    assert (err.job, err.group, err.step, err.rank) == ("job-a", "actor", 7, None)
    assert err.terms == ("tok", "grp")
    assert err.values == (0.0, 0.0)
    for part in ("'job-a'", "'actor'", "step 7", "'tok'=0.0", "'grp'=0.0"):
        assert part in err.message
    assert "'seq'" not in err.message
    assert last.round is not None
    assert last.round.outcome is not None
    assert last.round.outcome.kind is OutcomeKind.REJECTED_EMPTY


@pytest.mark.parametrize(
    ("bad", "reason", "shown"),
    [
        (math.nan, RejectReason.NAN, "nan"),
        (math.inf, RejectReason.INFINITE, "inf"),
        (-0.5, RejectReason.NEGATIVE, "-0.5"),
    ],
)
def test_invalid_partial_aborts_the_round_naming_the_culprit(
    bad: float, reason: RejectReason, shown: str
) -> None:
    table, recorder = make_table()
    early = table.contribute(KEY, contribution(0, 3, tok=1.0), 0.0)
    culprit = table.contribute(KEY, contribution(1, 3, tok=bad), 1.0)
    late = table.contribute(KEY, contribution(2, 3, tok=1.0), 2.0)

    own = answer(culprit, 1)
    assert isinstance(own, InvalidPartialError)
    assert (own.rank, own.terms) == (1, ("tok",))
    assert f"rank 1 sent invalid partial 'tok'={shown}" in own.message
    assert "step 7" in own.message
    for admission, rank in ((early, 0), (late, 2)):
        err = answer(admission, rank)
        assert isinstance(err, RoundAbortedError)
        assert not isinstance(err, RoundTimeoutError)
        assert err.culprit_rank == 1
        assert "aborted because rank 1" in err.message
        assert f"'tok'={shown}" in err.message
    assert answer(early, 0) is answer(late, 2)
    assert ("rejected", KEY, reason) in recorder.calls


def test_invalid_first_arrival_still_aborts_ranks_that_arrive_later() -> None:
    table, _ = make_table()
    culprit = table.contribute(KEY, contribution(3, 2, tok=1.0), 0.0)  # rank outside the world
    assert culprit.created
    assert culprit.finished
    own = answer(culprit, 3)
    assert isinstance(own, InvalidPartialError)
    assert "rank 3 is outside world_size 2" in own.message
    later = answer(table.contribute(KEY, contribution(0, 2, tok=1.0), 1.0), 0)
    assert isinstance(later, RoundAbortedError)
    assert later.culprit_rank == 3


@pytest.mark.parametrize(
    ("terms", "reason", "phrase"),
    [
        (
            (("tok", 1.0), ("tok", 1.0)),
            RejectReason.DUPLICATE_TERM,
            "sent terms ['tok'] more than once",
        ),
        ((("1bad", 1.0),), RejectReason.BAD_TERM_NAME, "term name '1bad' must match"),
        ((("", 1.0),), RejectReason.BAD_TERM_NAME, "term names must be non-empty"),
        ((), RejectReason.BAD_TERM_NAME, "sent no partials"),
    ],
)
def test_malformed_terms_are_invalid(
    terms: tuple[tuple[str, float], ...], reason: RejectReason, phrase: str
) -> None:
    table, recorder = make_table()
    c = Contribution(
        rank=0,
        world_size=2,
        terms=tuple(t for t, _ in terms),
        values=tuple(v for _, v in terms),
        contracts=tuple("mean" for _ in terms),
    )
    err = answer(table.contribute(KEY, c, 0.0), 0)
    assert isinstance(err, InvalidPartialError)
    assert phrase in err.message
    assert ("rejected", KEY, reason) in recorder.calls


@pytest.mark.parametrize(
    ("second", "phrase", "terms"),
    [
        (contribution(1, 3, tok=1.0), "rank 1 sent world_size 3 but rank 0 sent world_size 2", ()),
        (
            contribution(1, 2, tok=1.0, kl=1.0),
            "rank 1 sent terms ['kl', 'tok'] but rank 0 sent terms ['tok']",
            ("kl",),
        ),
        (
            contribution(1, 2, {"tok": "sum:constant:divisor=8"}, tok=1.0),
            "rank 1 sent contract 'sum:constant:divisor=8' for term 'tok' but rank 0 sent 'mean:tok'",
            ("tok",),
        ),
    ],
)
def test_contract_mismatch_fails_the_round_for_every_rank(
    second: Contribution, phrase: str, terms: tuple[str, ...]
) -> None:
    table, _ = make_table()
    first = table.contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    disagreeing = table.contribute(KEY, second, 1.0)
    assert disagreeing.finished
    err = answer(first, 0)
    assert err is answer(disagreeing, 1)
    assert isinstance(err, ContractMismatchError)
    assert phrase in err.message
    assert err.ranks == (0, 1)
    assert err.terms == terms
    assert first.round is not None
    assert first.round.outcome is not None
    assert first.round.outcome.kind is OutcomeKind.CONTRACT_MISMATCH


def test_same_terms_in_another_order_is_no_mismatch() -> None:
    table, _ = make_table()
    table.contribute(KEY, contribution(0, 2, a=1.0, b=2.0), 0.0)
    done = table.contribute(KEY, contribution(1, 2, b=20.0, a=10.0), 0.0)
    outcome = answer(done, 1)
    assert isinstance(outcome, Outcome)
    assert [(n.term, n.value) for n in outcome.normalizers] == [("a", 11.0), ("b", 22.0)]


def test_timeout_names_every_missing_rank_also_to_late_ranks() -> None:
    table, recorder = make_table(round_timeout_s=5.0)
    waiting = table.contribute(KEY, contribution(1, 4, tok=1.0), 100.0)
    assert waiting.round is not None
    assert waiting.round.deadline == 105.0
    assert table.expire(104.9) == []
    assert table.expire(105.0) == [waiting.round]
    err = answer(waiting, 1)
    assert isinstance(err, RoundTimeoutError)
    assert err.missing_ranks == (0, 2, 3)
    assert "waiting for ranks [0, 2, 3] (3 of 4 missing)" in err.message
    assert not table.time_out(waiting.round, 200.0)  # already over
    late = answer(table.contribute(KEY, contribution(0, 4, tok=1.0), 300.0), 0)
    assert late is err
    assert recorder.count("finished") == 1


def test_identical_resend_is_deduplicated_before_and_after_completion() -> None:
    table, recorder = make_table()
    table.contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    again = table.contribute(KEY, contribution(0, 2, tok=1.0), 0.5)
    assert again.error is None
    assert again.round is not None
    assert again.round.arrived == 1
    assert answer(again, 0) is None  # still waiting, not counted twice
    done = table.contribute(KEY, contribution(1, 2, tok=2.0), 1.0)
    after = table.contribute(KEY, contribution(1, 2, tok=2.0), 2.0)
    assert answer(after, 1) is answer(done, 1)
    outcome = answer(done, 1)
    assert isinstance(outcome, Outcome)
    assert outcome.normalizers[0].value == 3.0
    assert (recorder.count("accepted"), recorder.count("retry")) == (2, 2)


def test_different_resend_conflicts_and_leaves_the_round_alone() -> None:
    table, recorder = make_table()
    table.contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    err = answer(table.contribute(KEY, contribution(0, 2, tok=4.0), 0.0), 0)
    assert isinstance(err, ConflictingContributionError)
    assert "rank 0 already contributed 'tok'=1.0" in err.message
    assert "now sent 'tok'=4.0" in err.message
    assert ("rejected", KEY, RejectReason.CONFLICTING) in recorder.calls
    outcome = answer(table.contribute(KEY, contribution(1, 2, tok=2.0), 0.0), 1)
    assert isinstance(outcome, Outcome)
    assert outcome.normalizers[0].value == 3.0
    # After completion a different re-send still conflicts.
    assert isinstance(
        answer(table.contribute(KEY, contribution(1, 2, tok=math.nan), 0.0), 1),
        ConflictingContributionError,
    )


def test_culprit_retry_gets_its_own_error_and_other_bad_ranks_theirs() -> None:
    table, _ = make_table()
    first = answer(table.contribute(KEY, contribution(0, 3, tok=-1.0), 0.0), 0)
    again = answer(table.contribute(KEY, contribution(0, 3, tok=-1.0), 1.0), 0)
    assert isinstance(first, InvalidPartialError)
    assert again is first
    other = answer(table.contribute(KEY, contribution(1, 3, tok=math.nan), 1.0), 1)
    assert isinstance(other, InvalidPartialError)
    assert other.rank == 1


def step_key(step: int, group: str = "actor", job: str = "job-a") -> RoundKey:
    return RoundKey(job, group, step)


def finish(table: RoundTable, key: RoundKey) -> None:
    assert table.contribute(key, contribution(0, 1, tok=1.0), 0.0).finished


def test_steps_behind_the_retained_window_are_stale() -> None:
    table, _ = make_table(retained_steps=10)
    finish(table, step_key(100))
    err = answer(table.contribute(step_key(90), contribution(0, 2, tok=1.0), 0.0), 0)
    assert isinstance(err, StaleRoundError)
    assert err.limit == "retained_steps"
    assert "newest step of the group is 100" in err.message
    assert table.contribute(step_key(91), contribution(0, 2, tok=1.0), 0.0).created


def test_steps_evicted_from_the_cache_are_stale_not_recollected() -> None:
    table, _ = make_table(finished_cache_size=2)
    for step in (1, 2, 3):
        finish(table, step_key(step))
    assert table.lookup(step_key(1)) is None
    assert table.lookup(step_key(2)) is not None
    err = answer(table.contribute(step_key(1), contribution(0, 1, tok=1.0), 0.0), 0)
    assert isinstance(err, StaleRoundError)
    cached = answer(table.contribute(step_key(2), contribution(0, 1, tok=1.0), 0.0), 0)
    assert isinstance(cached, Outcome)


def test_a_step_sent_out_of_order_is_not_stale_because_later_steps_were_evicted() -> None:
    # Pipelined steps may finish before an earlier one is sent by any rank; evicting
    # the later ones must not refuse the earlier one, which was never collected.
    table, _ = make_table(finished_cache_size=2, max_rounds_in_flight=8)
    for step in (2, 3, 4, 5):
        finish(table, step_key(step))
    assert table.lookup(step_key(2)) is None
    assert table.contribute(step_key(1), contribution(0, 2, tok=1.0), 0.0).created
    for evicted in (2, 3):
        err = answer(table.contribute(step_key(evicted), contribution(0, 1, tok=1.0), 0.0), 0)
        assert isinstance(err, StaleRoundError)
        assert err.limit == "retained_steps"


def test_rounds_pipeline_up_to_the_in_flight_limit() -> None:
    table, _ = make_table(max_rounds_in_flight=2)
    for step in (1, 2):
        assert table.contribute(step_key(step), contribution(0, 2, tok=1.0), 0.0).created
    err = answer(table.contribute(step_key(3), contribution(0, 2, tok=1.0), 0.0), 0)
    assert isinstance(err, LimitExceededError)
    assert err.limit == "max_rounds_in_flight"
    assert "max_rounds_in_flight=2" in err.message
    # Another group of the same job is not affected.
    assert table.contribute(step_key(3, "critic"), contribution(0, 2, tok=1.0), 0.0).created


@pytest.mark.parametrize(
    ("overrides", "keys", "limit"),
    [
        ({"max_groups_per_job": 2}, [step_key(1, g) for g in "abc"], "max_groups_per_job"),
        ({"max_jobs": 2}, [step_key(1, "g", j) for j in "abc"], "max_jobs"),
    ],
)
def test_group_and_job_limits(overrides: dict[str, int], keys: list[RoundKey], limit: str) -> None:
    table, _ = make_table(**overrides)
    *fitting, over = keys
    for key in fitting:
        finish(table, key)
    err = answer(table.contribute(over, contribution(0, 1, tok=1.0), 0.0), 0)
    assert isinstance(err, LimitExceededError)
    assert err.limit == limit


@pytest.mark.parametrize(
    ("c", "limit"),
    [
        (Contribution(0, 2, ("a", "b", "c", "d"), (1.0,) * 4, ("m",) * 4), "max_terms"),
        (contribution(0, 9, tok=1.0), "max_world_size"),
    ],
)
def test_request_limits_refuse_only_that_request(c: Contribution, limit: str) -> None:
    table, _ = make_table(max_terms=3, max_world_size=8)
    err = answer(table.contribute(KEY, c, 0.0), 0)
    assert isinstance(err, LimitExceededError)
    assert err.limit == limit
    assert table.lookup(KEY) is None


def test_world_size_zero_is_invalid() -> None:
    table, _ = make_table()
    err = answer(table.contribute(KEY, contribution(0, 0, tok=1.0), 0.0), 0)
    assert isinstance(err, InvalidPartialError)
    assert "world_size 0" in err.message


def test_shutdown_refuses_new_rounds_lets_live_ones_finish_then_aborts() -> None:
    table, recorder = make_table()
    table.contribute(step_key(1), contribution(0, 2, tok=1.0), 0.0)
    table.contribute(step_key(2), contribution(0, 2, tok=1.0), 0.0)
    table.close()
    refused = answer(table.contribute(step_key(3), contribution(0, 2, tok=1.0), 0.0), 0)
    assert isinstance(refused, CoordinatorUnavailableError)
    done = answer(table.contribute(step_key(1), contribution(1, 2, tok=1.0), 0.0), 1)
    assert isinstance(done, Outcome)
    aborted = table.abort_all(1.0)
    assert [rnd.key for rnd in aborted] == [step_key(2)]
    assert aborted[0].outcome is not None
    err = aborted[0].outcome.error_for(0)
    assert isinstance(err, CoordinatorUnavailableError)
    assert "shut down before ranks [1] arrived" in err.message
    assert ("finished", step_key(2), OutcomeKind.ABORTED_SHUTDOWN, 1.0, None) in recorder.calls


def test_jobs_and_groups_are_isolated() -> None:
    table, _ = make_table()
    keys = [RoundKey("j1", "actor", 1), RoundKey("j1", "critic", 1), RoundKey("j2", "actor", 1)]
    for value, key in enumerate(keys, start=1):
        table.contribute(key, contribution(0, 2, tok=float(value)), 0.0)
    # A mismatch in one group does not touch the others.
    table.contribute(keys[1], contribution(1, 3, tok=1.0), 0.0)
    for value, key in enumerate(keys, start=1):
        if key == keys[1]:
            continue
        outcome = answer(table.contribute(key, contribution(1, 2, tok=1.0), 0.0), 1)
        assert isinstance(outcome, Outcome)
        assert outcome.normalizers[0].value == value + 1.0


def test_lookup_and_listing_show_live_then_finished_rounds() -> None:
    table, _ = make_table()
    finish(table, RoundKey("j1", "g", 1))
    live = table.contribute(RoundKey("j1", "g", 2), contribution(2, 4, tok=1.5), 0.0).round
    table.contribute(RoundKey("j2", "g", 1), contribution(0, 2, tok=1.0), 0.0)
    assert live is not None
    assert live.arrived_ranks() == [2]
    assert live.missing_ranks() == [0, 1, 3]
    assert [(n.term, n.value) for n in live.partial_sums()] == [("tok", 1.5)]
    assert [r.key.step for r in table.rounds("j1")] == [2, 1]
    assert len(table.rounds()) == 3
    assert table.lookup(RoundKey("j1", "g", 9)) is None


def test_idle_groups_are_forgotten_after_their_ttl() -> None:
    table, recorder = make_table(idle_group_ttl_s=60.0, max_jobs=1)
    finish(table, RoundKey("old", "g", 1))
    table.expire(30.0)
    assert table.rounds("old")
    assert recorder.count("forgotten") == 0
    table.expire(61.0)
    assert table.rounds("old") == []
    assert recorder.calls[-1] == ("forgotten", "old", "g")
    assert table.contribute(RoundKey("new", "g", 1), contribution(0, 1, tok=1.0), 62.0).finished


class MemoryStore:
    """An OutcomeStore that also checks no rank could see an outcome before it was stored."""

    def __init__(self, table_ref: list[RoundTable]) -> None:
        self.outcomes: dict[RoundKey, Outcome] = {}
        self.table_ref = table_ref

    def put(self, outcome: Outcome) -> None:
        rnd = self.table_ref[0].lookup(outcome.key)
        assert rnd is not None
        assert rnd.outcome is None, "the outcome was visible before it was stored"
        self.outcomes[outcome.key] = outcome

    def get(self, key: RoundKey) -> Outcome | None:
        return self.outcomes.get(key)


def test_outcome_store_is_written_first_and_answers_after_a_restart() -> None:
    ref: list[RoundTable] = []
    store = MemoryStore(ref)
    settings = CoordinatorSettings(round_timeout_s=10.0)
    ref.append(RoundTable(settings, store=store))
    ref[0].contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    ref[0].contribute(KEY, contribution(1, 2, tok=2.0), 0.0)
    assert store.outcomes[KEY].normalizers[0].value == 3.0

    restarted = RoundTable(settings, store=store)
    replay = answer(restarted.contribute(KEY, contribution(1, 2, tok=2.0), 0.0), 1)
    assert replay is store.outcomes[KEY]


def test_a_late_rank_that_disagrees_with_a_completed_round_gets_a_mismatch_not_the_outcome() -> (
    None
):
    table, _ = make_table()
    table.contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    table.contribute(KEY, contribution(1, 2, tok=2.0), 0.0)
    rnd = table.lookup(KEY)
    assert rnd is not None
    before = rnd.outcome
    assert before is not None
    # Rank 2 believes in a world of 3: its partial was never counted, so the
    # completed normalizers must not be its answer.
    late = contribution(2, 3, tok=5.0)
    err = answer(table.contribute(KEY, late, 20.0), 2)
    assert isinstance(err, ContractMismatchError)
    assert err.message.startswith("job 'job-a' group 'actor' step 7: ")
    assert "rank 2 sent world_size 3 but rank 0 sent world_size 2" in err.message
    assert err.ranks == (0, 2)
    assert rnd.outcome is before  # the round's answer to its own ranks is unchanged
    # A retry of the late contribution gets the same error again.
    again = answer(table.contribute(KEY, late, 30.0), 2)
    assert isinstance(again, ContractMismatchError)
    assert again.message == err.message


@pytest.mark.parametrize(
    "late",
    [
        contribution(1, 2, kl=5.0),
        contribution(1, 2, {"tok": "sum:constant:divisor=8"}, tok=5.0),
        contribution(1, 3, tok=5.0),
    ],
)
def test_a_late_rank_of_a_failed_round_gets_the_failure_whatever_it_sent(
    late: Contribution,
) -> None:
    # A failure is every rank's answer; a disagreeing latecomer gets it too.
    table, _ = make_table()
    table.contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    rnd = table.lookup(KEY)
    assert rnd is not None
    table.time_out(rnd, 10.0)
    err = answer(table.contribute(KEY, late, 20.0), late.rank)
    assert isinstance(err, RoundTimeoutError)
    assert err.missing_ranks == (1,)


def test_a_late_rank_outside_the_world_size_is_invalid_not_answered_the_outcome() -> None:
    table, recorder = make_table()
    table.contribute(KEY, contribution(0, 2, tok=1.0), 0.0)
    done = table.contribute(KEY, contribution(1, 2, tok=2.0), 0.0)
    err = answer(table.contribute(KEY, contribution(2, 2, tok=5.0), 1.0), 2)
    assert isinstance(err, InvalidPartialError)
    assert err.rank == 2
    assert "rank 2 is outside world_size 2" in err.message
    assert ("rejected", KEY, RejectReason.RANK_OUT_OF_RANGE) in recorder.calls
    outcome = answer(done, 1)
    assert isinstance(outcome, Outcome)
    assert outcome.normalizers[0].value == 3.0


def _restart_after(*steps: tuple[Contribution, float]) -> tuple[RoundTable, MemoryStore]:
    """Run ``steps`` on a table with a store, then a fresh table on the same store."""
    ref: list[RoundTable] = []
    store = MemoryStore(ref)
    settings = CoordinatorSettings(round_timeout_s=10.0)
    ref.append(RoundTable(settings, store=store))
    for c, now in steps:
        ref[0].contribute(KEY, c, now)
    ref[0].expire(100.0)
    assert KEY in store.outcomes
    return RoundTable(settings, store=store), store


def test_after_a_restart_a_different_resend_conflicts_and_an_identical_one_is_answered() -> None:
    restarted, store = _restart_after(
        (contribution(0, 2, tok=1.0, kl=0.5), 0.0), (contribution(1, 2, kl=0.25, tok=2.0), 0.0)
    )
    same = answer(restarted.contribute(KEY, contribution(1, 2, kl=0.25, tok=2.0), 0.0), 1)
    assert same is store.outcomes[KEY]
    for resend in (
        contribution(1, 2, kl=0.25, tok=99.0),
        contribution(1, 2, tok=2.0, kl=0.25),  # another order is another contribution, as live
        contribution(1, 2, other=1.0),
        contribution(1, 3, kl=0.25, tok=2.0),
    ):
        err = answer(restarted.contribute(KEY, resend, 0.0), 1)
        assert isinstance(err, ConflictingContributionError), resend
        assert err.message.startswith("job 'job-a' group 'actor' step 7: rank 1 already ")
        assert "now sent" in err.message
        assert err.rank == 1
    # A negative zero is the same partial as 0.0, as it is before a restart.
    restarted, store = _restart_after(
        (contribution(0, 2, tok=0.0), 0.0), (contribution(1, 2, tok=1.0), 0.0)
    )
    zero = answer(restarted.contribute(KEY, contribution(0, 2, tok=-0.0), 0.0), 0)
    assert zero is store.outcomes[KEY]


def test_after_a_restart_a_rank_that_never_arrived_gets_the_rounds_ending() -> None:
    restarted, store = _restart_after((contribution(0, 3, tok=1.0), 0.0))
    timeout = store.outcomes[KEY].error
    assert isinstance(timeout, RoundTimeoutError)
    late = answer(restarted.contribute(KEY, contribution(1, 3, tok=2.0), 0.0), 1)
    assert late is timeout
    # The round failed: that failure is every rank's answer, whatever it sends.
    for c in (contribution(1, 2, tok=2.0), contribution(2, 3, kl=2.0)):
        assert answer(restarted.contribute(KEY, c, 0.0), c.rank) is timeout
    outside = answer(restarted.contribute(KEY, contribution(3, 3, tok=2.0), 0.0), 3)
    assert isinstance(outside, InvalidPartialError)
    assert outside.rank == 3


def test_an_outcome_stored_without_its_record_still_refuses_other_terms() -> None:
    # A journal written before outcomes carried their record: only the terms are known.
    restarted, store = _restart_after(
        (contribution(0, 2, tok=1.0), 0.0), (contribution(1, 2, tok=2.0), 0.0)
    )
    stored = store.outcomes[KEY]
    store.outcomes[KEY] = Outcome(KEY, stored.kind, normalizers=stored.normalizers)
    assert store.outcomes[KEY].record is None
    retry = answer(restarted.contribute(KEY, contribution(1, 2, tok=2.0), 0.0), 1)
    assert retry is store.outcomes[KEY]
    err = answer(restarted.contribute(KEY, contribution(1, 2, kl=2.0), 0.0), 1)
    assert isinstance(err, ContractMismatchError)
    assert "rank 1 sent terms ['kl'] but the round completed with terms ['tok']" in err.message
    assert err.terms == ("kl", "tok")


def test_limits_hold_in_a_group_that_already_exists() -> None:
    """Names are judged once per group and contracts once per distinct tuple; a later
    contribution to the same group with a too-long contract is still refused."""
    table = RoundTable(CoordinatorSettings(max_contract_length=16))
    first = table.contribute(KEY, contribution(0, 2, tokens=1.0), 0.0)
    assert first.error is None
    long = contribution(1, 2, {"tokens": "x" * 17}, tokens=1.0)
    refused = table.contribute(KEY, long, 0.0)
    assert isinstance(refused.error, InvalidPartialError)
    assert refused.error.limit == "max_contract_length"
    assert refused.error.rank == 1
    # The sender alone is refused: the round still completes with rank 1's valid send.
    done = table.contribute(KEY, contribution(1, 2, tokens=2.0), 0.0)
    assert isinstance(answer(done, 1), Outcome)
    next_step = RoundKey(KEY.job, KEY.group, KEY.step + 1)
    again = table.contribute(next_step, contribution(0, 2, {"tokens": "y" * 17}, tokens=1.0), 0.0)
    assert isinstance(again.error, InvalidPartialError)
    assert again.error.limit == "max_contract_length"
