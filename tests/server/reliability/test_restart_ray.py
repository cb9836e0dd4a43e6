"""The coordinator as a Ray actor: Ray restarts it, and its journal answers what it finished.

``lossreduce train`` hosts the coordinator as a named actor with
``max_restarts``; the actor is pinned to the driver's node and reopens the
journal the driver chose there. Here the actor is killed the way a crash
kills it (``ray.kill(..., no_restart=False)``); Ray starts it again at the
same address and a rank that never read its answer gets the identical one.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import SecretStr

from lossreduce.client import AsyncReductionClient, ClientSettings
from lossreduce.client._transport import call_metadata
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc
from tests.ray_support import local_ray

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client configured with ``token`` sends."""
    return call_metadata(ClientSettings(token=SecretStr(token)))


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray(num_cpus=1):
        yield


def _wait_restarted(target: str, token: str, job: str) -> None:
    """Until a fresh coordinator process serves: one that no longer has step 0 in memory."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if _state(target, token, job) == pb.ROUND_STATE_UNKNOWN:
                return
        except grpc.RpcError:
            pass  # between the old process and the new one
        time.sleep(0.1)
    raise AssertionError(f"the coordinator actor never came back on {target}")


def _state(target: str, token: str, job: str) -> int:
    with grpc.insecure_channel(target) as channel:
        status = pb_grpc.ReductionCoordinatorStub(channel).GetRound(
            pb.GetRoundRequest(round=pb.RoundKey(job=job, group="actor", step=0)),
            metadata=bearer(token),
            timeout=10,
        )
    state: int = status.state
    return state


def test_a_restarted_coordinator_actor_answers_from_its_journal(
    ray_session: None, tmp_path: Path, workload: Any, retrying: Any
) -> None:
    from lossreduce.trainer_worker.integrations.coordinator_actor import start_coordinator_actor

    token = secrets.token_urlsafe(24)
    journal = tmp_path / "coordinator.sqlite3"
    handle = start_coordinator_actor(
        "ray-restart", round_timeout_s=30.0, token=SecretStr(token), journal=journal
    )
    handle.wait_ready(120)
    settings: ClientSettings = retrying(token=token)
    job, world = "ray-restart", 2

    async def rank0_reduces_while_rank1_hangs_up() -> dict[str, float]:
        async with grpc.aio.insecure_channel(handle.target) as channel:
            stub = pb_grpc.ReductionCoordinatorStub(channel)
            lost = stub.Reduce(
                workload.request(job, 1, world, 0), metadata=bearer(token), timeout=30
            )
            key = pb.RoundKey(job=job, group="actor", step=0)
            for _ in range(1_000):
                status = await stub.GetRound(
                    pb.GetRoundRequest(round=key), metadata=bearer(token), timeout=5
                )
                if 1 in status.arrived_ranks:
                    break
                await asyncio.sleep(0.01)
            lost.cancel()
        async with AsyncReductionClient(
            handle.target, job=job, group="actor", rank=0, world_size=world, settings=settings
        ) as rank0:
            return await rank0.reduce(0, workload.partials(0, 0), workload.contracts)

    try:
        answered = asyncio.run(rank0_reduces_while_rank1_hangs_up())
        assert answered == workload.expected(world, 0)

        assert _state(handle.target, token, job) == pb.ROUND_STATE_COMPLETED
        ray.kill(handle.actor, no_restart=False)  # a crash: Ray restarts the actor
        # A fresh process: the finished round is no longer in memory, only in the journal.
        _wait_restarted(handle.target, token, job)

        async def rank1_retries() -> dict[str, float]:
            async with AsyncReductionClient(
                handle.target, job=job, group="actor", rank=1, world_size=world, settings=settings
            ) as rank1:
                return await asyncio.wait_for(
                    rank1.reduce(0, workload.partials(1, 0), workload.contracts), timeout=20
                )

        retried = asyncio.run(rank1_retries())
        assert {t: v.hex() for t, v in retried.items()} == {t: v.hex() for t, v in answered.items()}
    finally:
        handle.stop()
    left = sorted(p.name for p in tmp_path.glob(f"{journal.name}*"))
    assert left == [], f"the driver removes the journal (and -wal, -shm) at the end: {left}"
