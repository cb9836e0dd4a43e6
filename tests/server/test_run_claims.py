"""The claims state machine (``server/run_claims.py``) alone, and inside the round table."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lossreduce.errors import RunConflictError
from lossreduce.server import Contribution, CoordinatorSettings, RoundKey, RoundTable
from lossreduce.server.run_claims import MAX_REPLACED_RUNS, ClaimRecord, RunClaims

JOB, GROUP = "job-c", "actor"


def test_the_first_run_claims_and_a_second_at_the_same_step_is_refused() -> None:
    claims = RunClaims()
    assert claims.admit(JOB, GROUP, "a", 0, now=1.0, wall=100.0) is None
    refused = claims.admit(JOB, GROUP, "b", 0, now=2.0, wall=101.0)
    assert refused is not None
    assert (refused.run, refused.holder, refused.since, refused.replaced) == (
        "b",
        "a",
        100.0,
        False,
    )
    assert claims.changed == [ClaimRecord(JOB, GROUP, "a", 100.0, 0)]


def test_the_holder_is_always_admitted_and_its_newest_step_advances() -> None:
    claims = RunClaims()
    for step in (0, 1, 5, 3):
        assert claims.admit(JOB, GROUP, "a", step, now=step, wall=100.0) is None
    holder = claims.holder(JOB, GROUP)
    assert holder is not None
    assert (holder.run, holder.newest_step) == ("a", 5)
    refused = claims.admit(JOB, GROUP, "b", 5, now=9.0, wall=109.0)
    assert refused is not None
    assert refused.newest_step == 5


def test_a_run_past_the_holders_newest_step_takes_over_and_the_old_run_is_refused() -> None:
    claims = RunClaims()
    claims.admit(JOB, GROUP, "a", 10, now=0.0, wall=100.0)
    assert claims.admit(JOB, GROUP, "resumed", 11, now=1.0, wall=200.0) is None
    holder = claims.holder(JOB, GROUP)
    assert holder is not None
    assert (holder.run, holder.since) == ("resumed", 200.0)
    old = claims.admit(JOB, GROUP, "a", 12, now=2.0, wall=201.0)
    assert old is not None
    assert old.replaced
    assert old.holder == "resumed"
    assert [r.run for r in claims.changed] == ["a", "resumed"]


def test_an_empty_run_is_never_checked_and_claims_nothing() -> None:
    claims = RunClaims()
    assert claims.admit(JOB, GROUP, "", 0, now=0.0, wall=0.0) is None
    assert claims.holder(JOB, GROUP) is None
    claims.admit(JOB, GROUP, "a", 0, now=0.0, wall=0.0)
    assert claims.admit(JOB, GROUP, "", 0, now=0.0, wall=0.0) is None
    assert len(claims) == 1


def test_replaced_runs_are_remembered_boundedly() -> None:
    claims = RunClaims()
    for i in range(3 * MAX_REPLACED_RUNS):
        assert claims.admit(JOB, GROUP, f"r{i}", i, now=i, wall=i) is None
    holder = claims.holder(JOB, GROUP)
    assert holder is not None
    assert len(holder.replaced) == MAX_REPLACED_RUNS


def test_claims_of_known_groups_wait_for_their_group_and_others_expire() -> None:
    claims = RunClaims()
    claims.admit(JOB, "known", "a", 0, now=0.0, wall=0.0)
    claims.admit(JOB, "never-opened", "a", 0, now=0.0, wall=0.0)
    assert claims.expire(5.0, 10.0, groups={(JOB, "known")}) == []
    assert claims.expire(10.0, 10.0, groups={(JOB, "known")}) == [(JOB, "never-opened")]
    assert claims.forget(JOB, "known")
    assert len(claims) == 0


def test_restored_claims_start_their_idle_time_at_the_first_sweep() -> None:
    claims = RunClaims()
    claims.restore([ClaimRecord(JOB, GROUP, "a", 50.0, 7)])
    assert claims.expire(1e6, 10.0, groups=set()) == []
    refused = claims.admit(JOB, GROUP, "b", 7, now=1e6 + 1, wall=60.0)
    assert refused is not None
    assert refused.holder == "a"
    assert claims.expire(1e6 + 10, 10.0, groups=set()) == [(JOB, GROUP)]


@given(st.lists(st.tuples(st.sampled_from(["", "a", "b", "c"]), st.integers(0, 20)), max_size=40))
def test_only_a_run_past_every_step_of_the_holder_ever_takes_a_group(
    events: list[tuple[str, int]],
) -> None:
    claims = RunClaims()
    holder: str | None = None
    newest = -1
    for t, (run, step) in enumerate(events):
        verdict = claims.admit(JOB, GROUP, run, step, now=t, wall=t)
        if not run:
            assert verdict is None
        elif holder is None or run == holder:
            assert verdict is None
            holder, newest = run, max(newest, step) if run == holder else step
        elif verdict is None:
            # A takeover: strictly past everything the previous holder contributed.
            assert step > newest
            holder, newest = run, step
        else:
            assert verdict.holder == holder
        claim = claims.holder(JOB, GROUP)
        assert (claim.run, claim.newest_step) == (holder, newest) if claim else holder is None


def contribution(rank: int, run: str, value: float = 1.0) -> Contribution:
    return Contribution(rank, 2, ("pg",), (value,), ("",), run=run)


def test_the_table_refuses_a_second_run_before_its_contribution_touches_the_round() -> None:
    table = RoundTable(CoordinatorSettings(), wall_clock=lambda: 1_000.0)
    key = RoundKey(JOB, GROUP, 0)
    assert table.contribute(key, contribution(0, "a"), now=0.0).error is None
    refused = table.contribute(key, contribution(1, "b", 5.0), now=1.0)
    assert isinstance(refused.error, RunConflictError)
    assert refused.round is None
    assert (refused.error.run, refused.error.holder, refused.error.held_since) == ("b", "a", 1000.0)
    rnd = table.lookup(key)
    assert rnd is not None
    assert rnd.arrived_ranks() == [0]
    done = table.contribute(key, contribution(1, "a", 2.0), now=2.0)
    assert done.finished
    assert done.round is not None
    assert done.round.outcome is not None
    assert [n.value for n in done.round.outcome.normalizers] == [3.0]


def test_the_claim_goes_with_the_idle_group() -> None:
    settings = CoordinatorSettings(idle_group_ttl_s=10.0)
    table = RoundTable(settings)
    key = RoundKey(JOB, GROUP, 0)
    table.contribute(key, Contribution(0, 1, ("pg",), (1.0,), ("",), run="a"), now=0.0)
    table.expire(5.0)
    assert table.holder(JOB, GROUP) is not None
    table.expire(10.0)
    assert table.holder(JOB, GROUP) is None
    fresh = table.contribute(key, Contribution(0, 1, ("pg",), (2.0,), ("",), run="b"), now=11.0)
    assert fresh.error is None


def test_a_run_id_is_bounded_and_printable_like_a_job_name() -> None:
    table = RoundTable(CoordinatorSettings(max_name_length=16))
    key = RoundKey(JOB, GROUP, 0)
    for bad in ("r" * 17, "run\n1"):
        refused = table.contribute(key, Contribution(0, 1, ("pg",), (1.0,), ("",), run=bad), 0.0)
        assert refused.error is not None
        assert refused.error.limit == "max_name_length"
    assert table.holder(JOB, GROUP) is None
