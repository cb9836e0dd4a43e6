"""Faults: a rank's process dies, a rank comes back late, SIGTERM under load, dead connections."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from typing import Any

import grpc
import pytest

from lossreduce.client import (
    AsyncReductionClient,
    ClientSettings,
    CoordinatorUnavailableError,
    LossReduceError,
    RoundTimeoutError,
)
from lossreduce.server import CoordinatorSettings
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc
from tests.tcp_proxy import TcpProxy

_RANK_PROCESS = textwrap.dedent(
    """
    import sys, time
    from lossreduce.client import ClientSettings, ReductionClient

    target, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    settings = ClientSettings(token=None, call_timeout_s=60.0)
    with ReductionClient(target, job="killed", group="actor", rank=rank, world_size=world,
                         settings=settings) as client:
        print("ready", flush=True)  # imports done: on a loaded machine they take seconds
        client.reduce(0, {"tokens": 1.0})
        print("step 0 done", flush=True)
        time.sleep(3600)  # stuck in the backward pass, until SIGKILL
    """
)


def _client(target: str, job: str, rank: int, world: int, **settings: Any) -> AsyncReductionClient:
    return AsyncReductionClient(
        target,
        job=job,
        group="actor",
        rank=rank,
        world_size=world,
        settings=ClientSettings.model_validate({"token": None, **settings}),
    )


async def _arrived(target: str, job: str, step: int, count: int) -> None:
    """Return once ``count`` ranks of round ``(job, actor, step)`` reached the coordinator;
    fails after 30 s (they are already on their way)."""
    key = pb.RoundKey(job=job, group="actor", step=step)

    async def poll() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ReductionCoordinatorStub(channel)
            request = pb.GetRoundRequest(round=key)
            while len((await stub.GetRound(request, timeout=5)).arrived_ranks) < count:
                await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout=30)


def test_a_killed_rank_process_aborts_its_peers_at_the_round_timeout(
    coordinator_factory: Any,
) -> None:
    coord = coordinator_factory(round_timeout_s=1.5)
    world = 3
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK_PROCESS, coord.target, "2", str(world)],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def main() -> list[BaseException | dict[str, float]]:
        assert proc.stdout is not None
        # Step 0's round starts only once rank 2 can take part within its 1.5 s timeout.
        assert await asyncio.to_thread(proc.stdout.readline) == "ready\n"
        peers = [_client(coord.target, "killed", r, world) for r in (0, 1)]
        await asyncio.gather(*(p.reduce(0, {"tokens": 1.0}) for p in peers))
        assert await asyncio.to_thread(proc.stdout.readline) == "step 0 done\n"
        waiting = [asyncio.create_task(p.reduce(1, {"tokens": 1.0})) for p in peers]
        await _arrived(coord.target, "killed", 1, 2)
        os.kill(proc.pid, signal.SIGKILL)  # rank 2 dies mid-round, its connection with it
        try:
            # Bounded: a hang fails here instead of blocking the suite.
            return await asyncio.wait_for(
                asyncio.gather(*waiting, return_exceptions=True), timeout=60
            )
        finally:
            for p in peers:
                await p.close()

    try:
        results = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    for rank, result in zip((0, 1), results, strict=True):
        assert isinstance(result, RoundTimeoutError), result
        assert result.missing_ranks == (2,)
        assert result.rank == rank
        assert "job 'killed' group 'actor' step 1" in str(result)
        assert "ranks [2]" in str(result)


def test_a_straggler_gets_the_aborted_outcome_not_a_fresh_round(coordinator_factory: Any) -> None:
    coord = coordinator_factory(round_timeout_s=0.5)

    async def main() -> tuple[BaseException, BaseException]:
        async with (
            _client(coord.target, "late", 0, 2) as rank0,
            _client(coord.target, "late", 1, 2) as rank1,
        ):
            with pytest.raises(RoundTimeoutError) as first:
                await rank0.reduce(0, {"tokens": 1.0})
            # Rank 1 was partitioned; it comes back long after the abort.
            with pytest.raises(RoundTimeoutError) as late:
                await rank1.reduce(0, {"tokens": 2.0})
            # Rank 0 retrying gets the same ending, not a new round that rank 1 could complete.
            with pytest.raises(RoundTimeoutError) as again:
                await rank0.reduce(0, {"tokens": 1.0})
            assert str(again.value) == str(first.value)
            return first.value, late.value

    first, late = asyncio.run(main())
    assert isinstance(first, RoundTimeoutError)
    assert isinstance(late, RoundTimeoutError)
    assert first.missing_ranks == late.missing_ranks == (1,)
    assert late.rank == 1
    with grpc.insecure_channel(coord.target) as channel:
        status = pb_grpc.ReductionCoordinatorStub(channel).GetRound(
            pb.GetRoundRequest(round=pb.RoundKey(job="late", group="actor", step=0)), timeout=5
        )
    assert status.state == pb.ROUND_STATE_FAILED
    assert list(status.arrived_ranks) == [0]


def test_sigterm_under_load_leaves_no_round_half_answered(
    serve_factory: Any, workload: Any
) -> None:
    world, job = 8, "drain"
    server = serve_factory(args=["--shutdown-grace-s", "2", "--round-timeout-s", "30"])
    outcomes: dict[int, dict[int, str]] = defaultdict(dict)
    started = asyncio.Event

    async def rank(r: int, go: asyncio.Event) -> None:
        # No retries: every answer the rank gets is from the coordinator being drained.
        async with _client(server.target, job, r, world, retry_budget_s=0.0) as client:
            await go.wait()
            for step in range(100_000):
                try:
                    got = await client.reduce(step, workload.partials(r, step), workload.contracts)
                except CoordinatorUnavailableError:
                    outcomes[step][r] = "UNAVAILABLE"
                    return
                except LossReduceError as exc:
                    outcomes[step][r] = type(exc).__name__
                    return
                outcomes[step][r] = repr({t: v.hex() for t, v in got.items()})

    async def main() -> None:
        go = started()
        tasks = [asyncio.create_task(rank(r, go)) for r in range(world)]
        go.set()
        while len(outcomes) < 30:
            await asyncio.sleep(0.01)
        code = await asyncio.to_thread(server.terminate)
        assert code == 0, server.log()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    asyncio.run(main())
    completed = 0
    for step, by_rank in sorted(outcomes.items()):
        answers = set(by_rank.values())
        ok = {a for a in answers if a.startswith("{")}
        if ok:
            # Answered: every rank got the same normalizers, none was cut off.
            assert answers == ok, f"step {step} half-answered: {by_rank}"
            assert len(by_rank) == world
            expected = {t: v.hex() for t, v in workload.expected(world, step).items()}
            assert ok == {repr(expected)}
            completed += 1
        else:
            assert answers == {"UNAVAILABLE"}, f"step {step}: {by_rank}"
    assert completed >= 30
    assert "stopped" in server.log()
    print(f"\nSIGTERM drain under load: {completed} rounds answered whole, then UNAVAILABLE")


# -- dead connections ---------------------------------------------------------------------


def test_server_keepalive_closes_a_dead_client_connection(coordinator_factory: Any) -> None:
    coord = coordinator_factory(keepalive_time_s=0.5, keepalive_timeout_s=0.5, round_timeout_s=60)

    async def main() -> None:
        proxy = TcpProxy(coord.port)
        await proxy.start()
        # The client never pings on its own (long keepalive): only the server can notice.
        client = _client(f"127.0.0.1:{proxy.port}", "dead-link", 0, 2, keepalive_time_s=3600.0)
        pending = asyncio.create_task(client.reduce(0, {"tokens": 1.0}))
        await _arrived(coord.target, "dead-link", 0, 1)
        proxy.frozen.set()
        # The coordinator's pings go unanswered, so it hangs up on the client.
        await asyncio.wait_for(proxy.upstream_closed.wait(), timeout=30)
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, LossReduceError):
            await pending
        await client.close()
        await proxy.close()

    asyncio.run(main())


def test_client_keepalive_gives_up_on_a_dead_coordinator(coordinator_factory: Any) -> None:
    coord = coordinator_factory(keepalive_min_ping_interval_s=0.1, round_timeout_s=60)

    async def main() -> None:
        proxy = TcpProxy(coord.port)
        await proxy.start()
        client = _client(
            f"127.0.0.1:{proxy.port}",
            "dead-server",
            0,
            2,
            keepalive_time_s=0.5,
            keepalive_timeout_s=0.5,
            retry_budget_s=0.0,
            call_timeout_s=600.0,
        )
        pending = asyncio.create_task(client.reduce(0, {"tokens": 1.0}))
        await _arrived(coord.target, "dead-server", 0, 1)
        proxy.frozen.set()
        # Without keepalive this call would sit for its 600 s deadline.
        with pytest.raises(CoordinatorUnavailableError):
            await asyncio.wait_for(pending, timeout=30)
        await client.close()
        await proxy.close()

    asyncio.run(main())


def test_client_keepalive_defaults_respect_the_server_enforcement() -> None:
    # A client pinging more often than the server tolerates gets GOAWAY (too_many_pings).
    assert ClientSettings().keepalive_time_s >= CoordinatorSettings().keepalive_min_ping_interval_s
