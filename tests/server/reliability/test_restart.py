"""SIGKILL and restart a real ``lossreduce serve`` on its journal: nothing lost, nothing twice.

The coordinator runs as a child process; ranks are asyncio clients in this
process. Every rank's answer for every step is compared bit for bit with what
an uninterrupted coordinator answers (``math.fsum`` over the ranks' partials).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import pytest

from lossreduce.client import AsyncReductionClient, ClientSettings, RoundTimeoutError
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc


def _hex(normalizers: dict[str, float]) -> dict[str, str]:
    return {term: value.hex() for term, value in normalizers.items()}


async def _arrived(stub: Any, job: str, step: int) -> list[int]:
    status = await stub.GetRound(
        pb.GetRoundRequest(round=pb.RoundKey(job=job, group="actor", step=step)), timeout=10
    )
    return list(status.arrived_ranks)


async def _wait_arrived(stub: Any, job: str, step: int, ranks: set[int]) -> None:
    for _ in range(2_000):
        if ranks <= set(await _arrived(stub, job, step)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"ranks {sorted(ranks)} never arrived at step {step}")


@pytest.mark.parametrize("journaled", [True, False], ids=["journal", "no-journal"])
def test_a_rank_that_missed_its_answer_gets_it_after_a_sigkill(
    serve_factory: Any, workload: Any, retrying: Any, journaled: bool
) -> None:
    """Rank 0 contributed to step 0 but never read the answer; its peers did and moved on.

    With the journal, rank 0's retry after the restart gets the identical
    answer and the job goes on. Without it (the control), the retry opens a
    fresh step 0 that nobody else joins: the job is stuck until the round
    timeout. That is what the journal is for.
    """
    world, job = 3, "missed-answer"
    server = serve_factory(
        journal="default" if journaled else None, args=["--round-timeout-s", "3"]
    )
    settings: ClientSettings = retrying(call_timeout_s=30.0)

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.ReductionCoordinatorStub(channel)
            # Rank 0 sends step 0 and hangs up before the round completes.
            lost = stub.Reduce(workload.request(job, 0, world, 0), timeout=30)
            await _wait_arrived(stub, job, 0, {0})
            lost.cancel()

        peers = [
            AsyncReductionClient(
                server.target, job=job, group="actor", rank=r, world_size=world, settings=settings
            )
            for r in (1, 2)
        ]
        got0 = await asyncio.gather(
            *(p.reduce(0, workload.partials(p.rank, 0), workload.contracts) for p in peers)
        )
        assert all(_hex(g) == _hex(workload.expected(world, 0)) for g in got0)
        # The peers move on to step 1 and wait there for rank 0.
        step1 = [
            asyncio.create_task(p.reduce(1, workload.partials(p.rank, 1), workload.contracts))
            for p in peers
        ]
        async with grpc.aio.insecure_channel(server.target) as channel:
            await _wait_arrived(pb_grpc.ReductionCoordinatorStub(channel), job, 1, {1, 2})

        await asyncio.to_thread(server.restart)  # SIGKILL, then start on the same journal

        async with AsyncReductionClient(
            server.target, job=job, group="actor", rank=0, world_size=world, settings=settings
        ) as rank0:
            if not journaled:
                with pytest.raises(RoundTimeoutError) as info:
                    await rank0.reduce(0, workload.partials(0, 0), workload.contracts)
                assert info.value.missing_ranks == (1, 2)
                for task in step1:
                    task.cancel()
                await asyncio.gather(*step1, return_exceptions=True)
                for p in peers:
                    await p.close()
                return
            retried = await rank0.reduce(0, workload.partials(0, 0), workload.contracts)
            assert _hex(retried) == _hex(got0[0])
            mine = await rank0.reduce(1, workload.partials(0, 1), workload.contracts)
        theirs = await asyncio.gather(*step1)
        for answer in (mine, *theirs):
            assert _hex(answer) == _hex(workload.expected(world, 1))
        for p in peers:
            await p.close()

    asyncio.run(main())


def test_sigkill_restarts_during_a_run_lose_and_double_count_nothing(
    serve_factory: Any, workload: Any, retrying: Any
) -> None:
    world, steps, job = 16, 120, "sigkill-run"
    kill_at = (15, 40, 65, 90)
    server = serve_factory(args=["--round-timeout-s", "60"])
    settings: ClientSettings = retrying()
    progress = [0] * world
    answers: list[dict[int, dict[str, str]]] = [{} for _ in range(world)]

    async def rank(r: int) -> None:
        async with AsyncReductionClient(
            server.target, job=job, group="actor", rank=r, world_size=world, settings=settings
        ) as client:
            for step in range(steps):
                answers[r][step] = _hex(
                    await client.reduce(step, workload.partials(r, step), workload.contracts)
                )
                progress[r] = step + 1

    async def killer() -> None:
        rng = random.Random(7)
        for threshold in kill_at:
            while min(progress) < threshold:
                await asyncio.sleep(0.005)
            # Land somewhere inside a round: collecting, completing or answering.
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            await asyncio.to_thread(server.restart)

    async def main() -> None:
        await asyncio.wait_for(
            asyncio.gather(killer(), *(rank(r) for r in range(world))), timeout=300
        )

    asyncio.run(main())
    assert server.starts == 1 + len(kill_at)
    for step in range(steps):
        expected = _hex(workload.expected(world, step))
        for r in range(world):
            assert answers[r][step] == expected, f"rank {r} step {step}"
    journal = server.journal
    assert journal is not None
    assert journal.exists()
    print(
        f"\n{world} ranks x {steps} steps with {len(kill_at)} SIGKILL restarts: "
        f"{world * steps} answers, all bit-identical to an uninterrupted run"
    )
