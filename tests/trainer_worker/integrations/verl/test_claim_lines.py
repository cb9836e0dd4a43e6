"""The line a launch prints once its actor ranks have claimed their group: one per group,
a takeover reported whichever rank's claim made it, and the form the launch tests read."""

from __future__ import annotations

from lossreduce.trainer_worker.integrations.verl.worker import RunClaim, describe_claims
from tests.trainer_worker.integrations.verl.background_launch import CLAIMED


def test_one_line_per_group_with_the_takeover_of_any_rank() -> None:
    # The coordinator reports a takeover to the rank whose claim made it: rank 1 here.
    ranks = [RunClaim("b2", "team", "actor", 6, False), RunClaim("b2", "team", "actor", 6, True)]
    (line,) = describe_claims(ranks)
    assert line == (
        "lossreduce: run 'b2' claimed job 'team' group 'actor' from round 6, "
        "taken over from the run it resumes"
    )
    fresh = [RunClaim("a1", "verl-ppo-a1", "actor", 0, False)] * 2
    assert describe_claims(fresh) == [
        "lossreduce: run 'a1' claimed job 'verl-ppo-a1' group 'actor' from round 0"
    ]


def test_sequence_parallel_groups_each_get_a_line() -> None:
    ranks = [RunClaim("a1", "team", f"actor.sp{i % 2}", 0, False) for i in range(4)]
    assert [CLAIMED.search(line)["group"] for line in describe_claims(ranks)] == [  # type: ignore[index]
        "actor.sp0",
        "actor.sp1",
    ]


def test_the_launch_tests_read_the_line() -> None:
    (taken,) = describe_claims([RunClaim("b2", "team", "actor", 6, True)])
    found = CLAIMED.search(f"(TaskRunnerV1 pid=1) {taken}")
    assert found is not None
    assert found.groupdict() == {
        "run": "b2",
        "job": "team",
        "group": "actor",
        "step": "6",
        "took_over": ", taken over",
    }
    (fresh,) = describe_claims([RunClaim("a1", "team", "actor", 0, False)])
    found = CLAIMED.search(fresh)
    assert found is not None
    assert found["took_over"] is None
