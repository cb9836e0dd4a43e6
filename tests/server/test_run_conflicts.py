"""Two runs, one coordinator: a real gRPC server on a free loopback port.

A run claims its job and group at its first round; another run naming them is
refused before any answer, on every rank, over unary calls and the stream;
the holder's retries keep their identical answer; a run resumed past the
holder's steps takes over; clients that name no run work as before; a
coordinator restarted on its journal still knows the holder.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from google.rpc import code_pb2

from lossreduce.errors import RunConflictError
from lossreduce.server import CoordinatorThread
from tests.conftest import CoordinatorFactory
from tests.raw_stub import Ranks, Received, Send

JOB = "verl-ppo"
WORLD = 4


def sends(run: str, step: int, value: float, *, job: str = JOB) -> list[Send]:
    return [
        Send(rank=r, world_size=WORLD, partials={"pg": value + r}, step=step, job=job, run=run)
        for r in range(WORLD)
    ]


def normalizers(received: list[Received]) -> list[dict[str, tuple[float, int]]]:
    return [r.normalizers for r in received]


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_a_second_run_is_refused_on_every_rank_naming_holder_and_fix(
    ranks: Ranks, mode: str
) -> None:
    before = time.time()
    first = ranks.round(sends("run-1", 0, 10.0), mode)
    assert normalizers(first) == [{"pg": (46.0, 0)}] * WORLD

    second = ranks.round(sends("run-2", 0, 20.0), mode)
    for rank, received in enumerate(second):
        assert received.code == code_pb2.FAILED_PRECONDITION
        err = received.error
        assert isinstance(err, RunConflictError)
        assert (err.job, err.group, err.step, err.rank) == (JOB, "actor", 0, rank)
        assert (err.run, err.holder) == ("run-2", "run-1")
        assert err.held_since is not None
        assert before - 1 <= err.held_since <= time.time()
        for needle in (
            "'run-1' holds",
            "'run-2' is refused",
            "unique job",
            "omit job",
            "idle_group_ttl_s",
        ):
            assert needle in str(err), str(err)
        # Since when, as a UTC time and an age.
        assert re.search(r"since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+ s ago", str(err))

    # Run 1's answer was never touched: its retry (same run) gets it, identical.
    retry = ranks.round(sends("run-1", 0, 10.0), mode)
    assert normalizers(retry) == normalizers(first)


def test_a_run_resumed_past_the_holders_steps_takes_over_and_the_old_run_is_refused(
    ranks: Ranks,
) -> None:
    for step in range(3):
        ranks.round(sends("run-1", step, 1.0), "stream")
    # Not past step 2: a collision, not a resume.
    collided = ranks.round(sends("resumed", 2, 1.0), "stream")
    assert all(isinstance(r.error, RunConflictError) for r in collided)

    resumed = ranks.round(sends("resumed", 3, 1.0), "stream")
    assert normalizers(resumed) == [{"pg": (10.0, 0)}] * WORLD
    old = ranks.round(sends("run-1", 4, 1.0), "unary")
    for received in old:
        err = received.error
        assert isinstance(err, RunConflictError)
        assert err.holder == "resumed"
        assert "'run-1' was replaced" in str(err), str(err)


def test_clients_that_name_no_run_work_as_before(ranks: Ranks) -> None:
    legacy = ranks.round(sends("", 0, 1.0, job="old-job"), "unary")
    assert normalizers(legacy) == [{"pg": (10.0, 0)}] * WORLD
    # Same contribution again: the cached answer, as before runs existed.
    assert normalizers(ranks.round(sends("", 0, 1.0, job="old-job"), "stream")) == normalizers(
        legacy
    )
    # A run may still claim the group a legacy client used; legacy rounds stay unchecked.
    assert normalizers(ranks.round(sends("run-x", 1, 1.0, job="old-job"), "unary"))[0]
    assert normalizers(ranks.round(sends("", 2, 1.0, job="old-job"), "unary"))[0]


def test_a_restarted_coordinator_still_refuses_a_collision(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.sqlite3"
    first: CoordinatorThread = coordinator_factory(journal=journal, metrics_port=None)
    ranks = Ranks(first.target)
    try:
        for step in range(3):
            ranks.round(sends("run-1", step, 1.0), "stream")
    finally:
        ranks.close()
    first.stop()

    second: CoordinatorThread = coordinator_factory(journal=journal, metrics_port=None)
    ranks = Ranks(second.target)
    try:
        refused = ranks.round(sends("run-2", 2, 1.0), "unary")
        for received in refused:
            err = received.error
            assert isinstance(err, RunConflictError)
            assert err.holder == "run-1"
            assert "its newest step is 2" in str(err), str(err)
        taken = ranks.round(sends("run-2", 3, 1.0), "unary")
        assert normalizers(taken) == [{"pg": (10.0, 0)}] * WORLD
    finally:
        ranks.close()
