"""Claiming a (job, group) at start-up (``Claim``): a real gRPC server on a free loopback port.

A launch that another run's claim would refuse learns it from ``claim()`` before
its first round, with the same ``RunConflictError`` a refused round raises; the
holder claiming again is admitted; a resumed run claiming past the holder's
newest step takes the claim over; the claim is the round's: a run claimed
before any round refuses a second run's first round, and survives a restart on
the journal; through a node agent as directly.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lossreduce.client import ReductionClient
from lossreduce.errors import InvalidPartialError, RunConflictError, UsageError
from lossreduce.server import CoordinatorThread
from lossreduce.trainer_worker.normalizers import (
    CoordinatorNormalizer,
    LocalNormalizer,
    SupportsClaim,
)
from tests.conftest import CoordinatorFactory

JOB = "areal-ppo"


def client(target: str, run: str, rank: int = 0, *, group: str = "actor") -> ReductionClient:
    return ReductionClient(target, job=JOB, group=group, rank=rank, world_size=2, run=run)


def test_a_second_launch_is_refused_at_its_claim_naming_the_holder(
    coordinator: CoordinatorThread,
) -> None:
    before = time.time()
    with (
        client(coordinator.target, "run-1") as first,
        client(coordinator.target, "run-2") as second,
    ):
        assert first.claim(0) is False
        assert first.claim(0) is False  # the holder again: admitted
        with pytest.raises(RunConflictError) as info:
            second.claim(0)
        err = info.value
        assert (err.job, err.group, err.step, err.rank) == (JOB, "actor", 0, 0)
        assert (err.run, err.holder) == ("run-2", "run-1")
        assert err.held_since is not None
        assert before - 1 <= err.held_since <= time.time()
        assert "'run-1' holds" in str(err), str(err)
        assert "'run-2' is refused" in str(err), str(err)
        # The holder's rounds are untouched by the refused claim.
        first_rank1 = client(coordinator.target, "run-1", rank=1)
        with first_rank1:
            pending = first_rank1.reduce_start(0, {"pg": 2.0})
            assert first.reduce(0, {"pg": 1.0}) == {"pg": 3.0}
            assert pending.result() == {"pg": 3.0}


def test_a_claim_made_before_any_round_refuses_another_runs_first_round(
    coordinator: CoordinatorThread,
) -> None:
    with (
        client(coordinator.target, "run-1") as first,
        client(coordinator.target, "run-2") as second,
    ):
        first.claim(0)
        with pytest.raises(RunConflictError) as info:
            second.reduce(0, {"pg": 1.0})
        assert info.value.holder == "run-1"


def test_a_resumed_run_claiming_past_the_holders_steps_takes_over(
    coordinator: CoordinatorThread,
) -> None:
    with client(coordinator.target, "run-1") as r0, client(coordinator.target, "run-1", 1) as r1:
        for step in range(3):
            pending = r1.reduce_start(step, {"pg": 1.0})
            r0.reduce(step, {"pg": 1.0})
            pending.result()
    with client(coordinator.target, "resumed") as resumed:
        with pytest.raises(RunConflictError, match="newest step is 2"):
            resumed.claim(2)  # not past step 2: a collision, not a resume
        assert resumed.claim(3) is True
        assert resumed.claim(3) is False  # now its own
    with client(coordinator.target, "run-1") as old, pytest.raises(RunConflictError) as info:
        old.claim(4)
    assert info.value.holder == "resumed"
    assert "'run-1' was replaced" in str(info.value)


def test_a_claim_survives_a_coordinator_restart_on_its_journal(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.sqlite3"
    first: CoordinatorThread = coordinator_factory(journal=journal, metrics_port=None)
    with client(first.target, "run-1") as holder:
        holder.claim(0)
    first.stop()
    second: CoordinatorThread = coordinator_factory(journal=journal, metrics_port=None)
    with client(second.target, "run-2") as other, pytest.raises(RunConflictError) as info:
        other.claim(0)
    assert info.value.holder == "run-1"


def test_a_claim_needs_a_run_and_valid_names(coordinator: CoordinatorThread) -> None:
    with client(coordinator.target, "") as legacy, pytest.raises(UsageError, match="run id"):
        legacy.claim(0)
    with (
        client(coordinator.target, "run-1", group="") as nameless,
        pytest.raises(InvalidPartialError, match="group name"),
    ):
        nameless.claim(0)


def test_the_normalizer_claims_through_its_client(coordinator: CoordinatorThread) -> None:
    with (
        client(coordinator.target, "run-1") as first,
        client(coordinator.target, "run-2") as second,
    ):
        assert isinstance(first, SupportsClaim)
        assert CoordinatorNormalizer(first).claim(0) is False
        with pytest.raises(RunConflictError):
            CoordinatorNormalizer(second).claim(0)
    with client(coordinator.target, "") as legacy:
        # A client naming no run claims nothing (its rounds are never checked).
        assert CoordinatorNormalizer(legacy).claim(0) is False
    # Backends without a coordinator have nothing to claim.
    assert LocalNormalizer().claim(0) is False
