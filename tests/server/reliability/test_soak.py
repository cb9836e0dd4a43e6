"""Soak: 64 ranks, many rounds, random faults; identical answers, no double count, flat memory.

The coordinator is a real ``lossreduce serve`` child (journal on, as shipped);
each rank is an asyncio task with its own channel and raw stub, so faults can
be injected precisely:

- ``drop``: close the rank's connection while its call is in flight, reconnect, re-send;
- ``duplicate``: send the same contribution twice at once (both must get the same answer);
- ``cancel``: cancel the in-flight call, re-send on the same connection;
- ``restart``: the rank "restarts": abandon the call and the connection, pause, come
  back on a fresh connection and re-send.

Every re-send is the identical contribution, so the coordinator must count
each rank once per round. The bounded form runs in CI; the full 64 x 2,000
form is ``@pytest.mark.soak`` and runs when ``LOSSREDUCE_SOAK=1``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from typing import Any

import grpc
import pytest

from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

FAULTS = ("drop", "duplicate", "cancel", "restart")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
MiB = 1024 * 1024


class Rank:
    """One simulated rank: a channel, a stub, and a habit of misbehaving."""

    def __init__(self, target: str, rank: int, rng: random.Random) -> None:
        self.target = target
        self.rank = rank
        self.rng = rng
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.ReductionCoordinatorStub(self.channel)

    async def reconnect(self) -> None:
        await self.channel.close(grace=None)
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.ReductionCoordinatorStub(self.channel)

    async def send(self, request: pb.ReduceRequest) -> pb.ReduceResponse:
        """Send until answered; retry what a lost connection or a cancel leaves behind."""
        for _ in range(100):
            try:
                response: pb.ReduceResponse = await self.stub.Reduce(request, timeout=60)
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
            await asyncio.sleep(0.01)
        raise AssertionError(f"rank {self.rank}: no answer after 100 attempts")

    async def abandon(self, request: pb.ReduceRequest) -> None:
        """Start the call and walk away from it at a random moment."""
        call = self.stub.Reduce(request, timeout=60)
        await asyncio.sleep(self.rng.uniform(0.0, 0.003))
        call.cancel()

    async def reduce(self, request: pb.ReduceRequest, fault: str | None) -> pb.ReduceResponse:
        if fault == "duplicate":
            first, second = await asyncio.gather(self.send(request), self.send(request))
            assert first == second, f"rank {self.rank}: a duplicate got another answer"
            return first
        if fault == "cancel":
            await self.abandon(request)
        elif fault == "drop":
            call = self.stub.Reduce(request, timeout=60)
            await asyncio.sleep(self.rng.uniform(0.0, 0.003))
            await self.reconnect()  # the connection goes down under the call
            call.cancel()
        elif fault == "restart":
            await self.abandon(request)
            await self.channel.close(grace=None)
            await asyncio.sleep(self.rng.uniform(0.0, 0.02))
            await self.reconnect()
        return await self.send(request)


def _soak(serve_factory: Any, workload: Any, *, world: int, rounds: int, fault_rate: float) -> None:
    job = "soak"
    server = serve_factory(
        # A small finished-round cache so memory reaches its plateau early in the run.
        args=["--finished-cache-size", "32", "--retained-steps", "64", "--round-timeout-s", "120"]
    )
    warmup = max(rounds // 5, 64)
    faults: collections.Counter[str] = collections.Counter()
    answers: list[list[str]] = [[""] * rounds for _ in range(world)]
    progress = [0] * world
    rss: dict[str, int] = {}

    async def run_rank(r: int) -> None:
        rng = random.Random(1000 + r)
        rank = Rank(server.target, r, rng)
        try:
            for step in range(rounds):
                fault = rng.choice(FAULTS) if rng.random() < fault_rate else None
                if fault is not None:
                    faults[fault] += 1
                response = await rank.reduce(workload.request(job, r, world, step), fault)
                assert not response.error.code, response.error.message
                answers[r][step] = repr([(n.term, n.value.hex()) for n in response.normalizers])
                progress[r] = step + 1
        finally:
            await rank.channel.close(grace=None)

    async def sample_rss() -> None:
        while min(progress) < warmup:
            await asyncio.sleep(0.05)
        rss["before"] = server.rss_bytes()

    async def main() -> None:
        await asyncio.wait_for(
            asyncio.gather(sample_rss(), *(run_rank(r) for r in range(world))), timeout=1800
        )

    started = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - started
    rss["after"] = server.rss_bytes()

    for step in range(rounds):
        expected = repr([(t, v.hex()) for t, v in workload.expected(world, step).items()])
        for r in range(world):
            assert answers[r][step] == expected, f"rank {r} step {step}"
    contributions = server.metric("lossreduce_contributions_total", job=job)
    deduplicated = server.metric("lossreduce_retries_deduplicated_total", job=job)
    completed = server.metric("lossreduce_rounds_total", job=job, outcome="completed")
    other = server.metric("lossreduce_rounds_total", job=job) - completed
    growth = rss["after"] - rss["before"]
    print(
        f"\nsoak: {world} ranks x {rounds} rounds in {elapsed:.1f} s; "
        f"faults injected {sum(faults.values())} ({dict(sorted(faults.items()))}); "
        f"rounds completed {completed:.0f}, other outcomes {other:.0f}; "
        f"contributions counted {contributions:.0f} (= {world} x {rounds}), "
        f"retries deduplicated {deduplicated:.0f}; "
        f"server RSS after warm-up ({warmup} rounds) {rss['before'] / MiB:.1f} MiB, "
        f"at the end {rss['after'] / MiB:.1f} MiB ({growth / MiB:+.1f} MiB)"
    )
    assert completed == rounds
    assert other == 0
    assert contributions == world * rounds, "a contribution was counted twice (or lost)"
    assert sum(faults.values()) > 0
    assert deduplicated > 0
    # Flat: once the bounded caches are full, more rounds take no more memory.
    assert growth < 16 * MiB, f"server RSS grew by {growth / MiB:.1f} MiB"


def test_soak_bounded(serve_factory: Any, workload: Any) -> None:
    _soak(serve_factory, workload, world=64, rounds=150, fault_rate=0.02)


@pytest.mark.soak
@pytest.mark.skipif(
    os.environ.get("LOSSREDUCE_SOAK") != "1", reason="full soak: set LOSSREDUCE_SOAK=1"
)
def test_soak_full(serve_factory: Any, workload: Any) -> None:
    _soak(serve_factory, workload, world=64, rounds=2_000, fault_rate=0.01)
