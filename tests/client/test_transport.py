"""Transport behaviour against a real coordinator: pipelining, concurrency,
deadlines, retries against a late or restarted coordinator, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import threading
import time

import grpc
import pytest

from lossreduce.client import (
    AsyncReductionClient,
    ClientSettings,
    CoordinatorUnavailableError,
    LossReduceError,
    ReductionClient,
    RoundResult,
)
from lossreduce.server import CoordinatorSettings, CoordinatorThread


def _settings(base: ClientSettings, **changes: object) -> ClientSettings:
    return base.model_copy(update=changes)


def test_pipelined_steps_are_matched_to_their_answers(coordinator, client_settings) -> None:
    steps = range(1, 7)

    async def rank(r: int, order: list[int]) -> dict[int, dict[str, float]]:
        async with AsyncReductionClient(
            coordinator.target,
            job="pipe",
            group="g",
            rank=r,
            world_size=2,
            settings=client_settings,
        ) as client:
            # All steps in flight at once over the one stream; rank 1 sends them
            # in reverse, so rank 0's early steps wait on rank 1's late sends.
            calls = {step: client.reduce(step, {"pg": float(step * (10**r))}) for step in order}
            answers = await asyncio.gather(*calls.values())
            return dict(zip(calls, answers, strict=True))

    async def both() -> list[dict[int, dict[str, float]]]:
        return list(await asyncio.gather(rank(0, list(steps)), rank(1, list(reversed(steps)))))

    for answers in asyncio.run(both()):
        assert answers == {step: {"pg": float(step + 10 * step)} for step in steps}


def test_many_clients_in_threads_agree(coordinator) -> None:
    world, steps = 12, (1, 2, 3)
    results: dict[tuple[int, int], dict[str, float]] = {}
    partial = [0.1 * (r + 1) for r in range(world)]

    def rank(r: int) -> None:
        # Half the ranks stream, half use unary calls; rounds mix both.
        settings = ClientSettings(use_stream=r % 2 == 0)
        with ReductionClient(
            coordinator.target,
            job="threads",
            group="g",
            rank=r,
            world_size=world,
            settings=settings,
        ) as client:
            for step in steps:
                results[(r, step)] = client.reduce(step, {"tokens": partial[r], "groups": r % 3})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = {"tokens": math.fsum(partial), "groups": float(sum(r % 3 for r in range(world)))}
    assert results == {(r, step): expected for r in range(world) for step in steps}


def test_one_client_shared_by_many_threads(coordinator, client_settings) -> None:
    steps = range(1, 9)
    clients = [
        ReductionClient(
            coordinator.target,
            job="shared",
            group="g",
            rank=r,
            world_size=2,
            settings=client_settings,
        )
        for r in (0, 1)
    ]
    results: dict[tuple[int, int], dict[str, float]] = {}

    def call(r: int, step: int) -> None:
        results[(r, step)] = clients[r].reduce(step, {"pg": 1.0 + r})

    threads = [threading.Thread(target=call, args=(r, s)) for s in steps for r in (0, 1)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for client in clients:
            client.close()
    assert results == {(r, s): {"pg": 3.0} for s in steps for r in (0, 1)}


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_call_deadline_then_the_client_keeps_working(
    coordinator, client_settings, wait_for_arrivals, assert_names_round
) -> None:
    short = _settings(client_settings, call_timeout_s=0.2)
    with (
        ReductionClient(
            coordinator.target, job="dl", group="actor", rank=0, world_size=2, settings=short
        ) as r0,
        ReductionClient(
            coordinator.target,
            job="dl",
            group="actor",
            rank=1,
            world_size=2,
            settings=client_settings,
        ) as r1,
    ):
        with pytest.raises(CoordinatorUnavailableError) as info:
            r0.reduce(1, {"pg": 1.0})
        assert_names_round(info.value, "dl", 1, 0)
        assert "within the call timeout of 0.2 s" in str(info.value)
        assert coordinator.target in str(info.value)
        # Rank 1 completes step 1; rank 0's late answer for it must not be
        # taken for the answer to step 2 on the shared stream.
        assert r1.reduce(1, {"pg": 2.0}) == {"pg": 3.0}
        later = threading.Thread(target=lambda: r1.reduce(2, {"pg": 20.0}))
        later.start()
        assert r0.reduce(2, {"pg": 10.0}) == {"pg": 30.0}
        later.join()


def test_retries_reach_a_coordinator_that_starts_late(
    coordinator_factory, free_port, client_settings
) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    patient = _settings(client_settings, retry_budget_s=30.0)
    outcome: list[object] = []

    def rank_0() -> None:
        with ReductionClient(
            target, job="late", group="g", rank=0, world_size=1, settings=patient
        ) as c:
            outcome.append(c.reduce_detailed(1, {"pg": 4.0}))

    caller = threading.Thread(target=rank_0)
    caller.start()
    time.sleep(0.3)  # let the first attempts fail; correctness does not depend on it
    coordinator_factory(port=port, metrics_port=None)
    caller.join()
    (result,) = outcome
    assert isinstance(result, RoundResult)
    assert result.normalizers == {"pg": 4.0}


def test_unreachable_coordinator_gives_up_naming_target_and_attempts(
    free_port, client_settings, assert_names_round
) -> None:
    target = f"127.0.0.1:{free_port()}"
    impatient = _settings(client_settings, retry_budget_s=0.3)
    with (
        ReductionClient(
            target, job="gone", group="actor", rank=3, world_size=4, settings=impatient
        ) as c,
        pytest.raises(CoordinatorUnavailableError) as info,
    ):
        c.reduce(5, {"pg": 1.0})
    err = info.value
    assert_names_round(err, "gone", 5, 3)
    assert f"the coordinator at {target} is unavailable; gave up after" in str(err)
    assert "attempts over" in str(err)


@pytest.mark.timeout(60)
def test_coordinator_stopping_mid_round_fails_fast_not_hangs(
    coordinator, client_settings, wait_for_arrivals, assert_names_round
) -> None:
    settings = _settings(client_settings, retry_budget_s=0.5)
    raised: list[BaseException] = []

    def rank_0() -> None:
        with ReductionClient(
            coordinator.target, job="stop", group="actor", rank=0, world_size=2, settings=settings
        ) as c:
            try:
                c.reduce(1, {"pg": 1.0})
            except LossReduceError as err:
                raised.append(err)

    caller = threading.Thread(target=rank_0)
    caller.start()
    wait_for_arrivals(coordinator.target, "stop", "actor", 1, [0])
    coordinator.stop(grace_s=0.0)
    caller.join()
    (err,) = raised
    assert isinstance(err, CoordinatorUnavailableError)
    assert_names_round(err, "stop", 1, 0)


@pytest.mark.timeout(60)
def test_round_survives_a_coordinator_restart_on_the_same_port(
    coordinator_factory, free_port, wait_for_arrivals
) -> None:
    port = free_port()
    first = coordinator_factory(port=port, metrics_port=None)
    target = first.target
    settings = ClientSettings(retry_budget_s=30.0, initial_backoff_s=0.02, max_backoff_s=0.2)
    outcome: list[object] = []
    with ReductionClient(
        target, job="restart", group="g", rank=0, world_size=2, settings=settings
    ) as r0:

        def rank_0() -> None:
            outcome.append(r0.reduce(1, {"pg": 1.0}))

        caller = threading.Thread(target=rank_0)
        caller.start()
        wait_for_arrivals(target, "restart", "g", 1, [0])
        # The stream breaks; rank 0 falls back to unary Reduce and retries
        # until the new coordinator is up, then re-contributes step 1 there.
        first.stop(grace_s=0.0)
        coordinator_factory(port=port, metrics_port=None)
        with ReductionClient(target, job="restart", group="g", rank=1, world_size=2) as r1:
            assert r1.reduce(1, {"pg": 2.0}) == {"pg": 3.0}
        caller.join()
        assert outcome == [{"pg": 3.0}]
        # The next step opens a fresh stream.
        with ReductionClient(target, job="restart", group="g", rank=1, world_size=2) as r1:
            done = threading.Thread(target=lambda: r1.reduce(2, {"pg": 5.0}))
            done.start()
            assert r0.reduce(2, {"pg": 5.0}) == {"pg": 10.0}
            done.join()


class _RefuseStreams(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Stands in for a proxy that cannot carry bidi streams: ReduceStream fails."""

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.endswith("/ReduceStream"):
            return grpc.stream_stream_rpc_method_handler(_refuse)
        return await continuation(handler_call_details)


async def _refuse(request_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no streams through this proxy")


def test_a_failing_stream_falls_back_to_unary_without_spending_the_retry_budget() -> None:
    settings = CoordinatorSettings.model_validate({"port": 0, "metrics_port": None})
    no_retries = ClientSettings(use_stream=True, retry_budget_s=0.0)
    with CoordinatorThread(settings, interceptors=[_RefuseStreams()]) as coord:
        outcomes = asyncio.run(_two_ranks(coord.target, no_retries))
    assert outcomes == [{"pg": 3.0}, {"pg": 3.0}]


async def _two_ranks(target: str, settings: ClientSettings) -> list[dict[str, float]]:
    async def rank(r: int) -> dict[str, float]:
        async with AsyncReductionClient(
            target, job="fallback", group="g", rank=r, world_size=2, settings=settings
        ) as client:
            return await client.reduce(1, {"pg": 1.0 + r})

    return list(await asyncio.gather(rank(0), rank(1)))


def test_calls_cancelled_mid_write_leave_no_unread_errors(coordinator) -> None:
    # A caller cancelled while its request is being written breaks the stream;
    # the StreamBrokenError its own waiter then holds is nobody's to read and must
    # not be logged by asyncio as a lost exception.
    reported: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
        async with AsyncReductionClient(
            coordinator.target, job="cancel-write", group="g", rank=0, world_size=2
        ) as client:
            for step in range(10):
                call = asyncio.create_task(client.reduce(step, {"pg": 1.0}))
                await asyncio.sleep(0)  # the call is now waiting on its write
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
            gc.collect()

    asyncio.run(main())
    assert not [m for m in reported if "never retrieved" in m], reported
