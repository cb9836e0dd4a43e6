"""Client lifecycle: states, context managers, close, use after close, bad arguments."""

from __future__ import annotations

import asyncio
import threading

import pytest

import lossreduce.client
from lossreduce import errors
from lossreduce.client import (
    AsyncReductionClient,
    ClientClosedError,
    ClientSettings,
    ClientState,
    ReductionClient,
)

UNUSED_TARGET = "127.0.0.1:9"  # never dialled: these clients are not used to reduce


CLIENT_ERRORS = {
    errors.LossReduceError,
    errors.ReductionError,
    errors.InvalidPartialError,
    errors.EmptyNormalizerError,
    errors.ContractMismatchError,
    errors.StaleRoundError,
    errors.RunConflictError,
    errors.RoundAbortedError,
    errors.RoundTimeoutError,
    errors.ConflictingContributionError,
    errors.LimitExceededError,
    errors.CoordinatorUnavailableError,
    errors.AuthenticationError,
    errors.ClientClosedError,
    errors.UsageError,
}
"""Every error a client can raise: re-exported, and the very classes of lossreduce.errors."""


def test_public_names_are_exported_and_errors_are_the_shared_ones() -> None:
    for name in lossreduce.client.__all__:
        assert hasattr(lossreduce.client, name), name
    exported = {
        obj
        for obj in (getattr(lossreduce.client, name) for name in lossreduce.client.__all__)
        if isinstance(obj, type) and issubclass(obj, errors.LossReduceError)
    }
    assert exported == CLIENT_ERRORS
    for cls in exported:
        assert getattr(errors, cls.__name__) is cls
    # Internals stay in their modules.
    assert not {"SupportsItem", "Backoff", "BASE_CHANNEL_OPTIONS"} & set(lossreduce.client.__all__)
    assert lossreduce.client.RoundResult.__module__ == "lossreduce.client.types"


@pytest.mark.parametrize("cls", [ReductionClient, AsyncReductionClient])
def test_identity_is_read_only(cls: type[ReductionClient] | type[AsyncReductionClient]) -> None:
    client = cls(UNUSED_TARGET, job="j", group="g", rank=1, world_size=2, run="r")
    try:
        identity = (client.job, client.group, client.rank, client.world_size, client.run)
        assert identity == ("j", "g", 1, 2, "r")
        with pytest.raises(AttributeError):
            client.rank = 0  # type: ignore[misc]
        with pytest.raises(AttributeError):
            client.run = "other"  # type: ignore[misc]
    finally:
        if isinstance(client, ReductionClient):
            client.close()


def test_sync_states_and_use_after_close() -> None:
    client = ReductionClient(UNUSED_TARGET, job="j", group="g", rank=1, world_size=2)
    states = [client.state]
    with client:
        states.append(client.state)
    states.append(client.state)
    assert states == [ClientState.UNOPENED, ClientState.OPEN, ClientState.CLOSED]
    client.close()  # idempotent
    with pytest.raises(ClientClosedError) as info:
        client.reduce(3, {"pg": 1.0})
    assert str(info.value) == "Cannot reduce step 3: the client for job 'j' rank 1 has been closed."
    assert (info.value.job, info.value.group, info.value.step, info.value.rank) == ("j", "g", 3, 1)
    with pytest.raises(ClientClosedError, match="Cannot open the client for job 'j' rank 1"):
        client.open()


def test_sync_client_runs_no_thread_and_closes_its_loop() -> None:
    # The caller's own thread drives the client's loop: no thread to stop.
    before = set(threading.enumerate())
    client = ReductionClient(UNUSED_TARGET, job="thread-test", group="g", rank=0, world_size=1)
    assert set(threading.enumerate()) == before
    client.close()
    assert client._driver.loop.is_closed()


def test_closing_an_unopened_client_never_dials() -> None:
    client = ReductionClient(UNUSED_TARGET, job="j", group="g", rank=0, world_size=1)
    client.close()
    assert client.state is ClientState.CLOSED


def test_async_states_and_use_after_close() -> None:
    async def scenario() -> None:
        client = AsyncReductionClient(UNUSED_TARGET, job="j", group="g", rank=2, world_size=4)
        states = [client.state]
        async with client:
            states.append(client.state)
        states.append(client.state)
        assert states == [ClientState.UNOPENED, ClientState.OPEN, ClientState.CLOSED]
        await client.close()
        with pytest.raises(
            ClientClosedError, match=r"^Cannot reduce step 0: .*'j' rank 2 has been closed\.$"
        ):
            await client.reduce(0, {"pg": 1.0})

    asyncio.run(scenario())


def test_async_client_refuses_a_second_event_loop() -> None:
    client = AsyncReductionClient(UNUSED_TARGET, job="j", group="g", rank=0, world_size=1)
    asyncio.run(client.open())
    with pytest.raises(errors.UsageError, match="opened on another event loop"):
        asyncio.run(client.reduce(1, {"pg": 1.0}))
    asyncio.run(client.close())


@pytest.mark.parametrize(
    ("rank", "world_size", "match"),
    [(-1, 2, "rank=-1"), (0, 0, "world_size=0"), (0, 2**32, "world_size=4294967296")],
)
def test_bad_identity_is_rejected_at_construction(rank: int, world_size: int, match: str) -> None:
    with pytest.raises(errors.UsageError, match=match) as info:
        AsyncReductionClient(UNUSED_TARGET, job="j", group="g", rank=rank, world_size=world_size)
    assert isinstance(info.value, ValueError)  # what callers caught before UsageError
    assert (info.value.job, info.value.group) == ("j", "g")


@pytest.mark.parametrize("step", [-1, 2**64, 1.5, True])
def test_bad_step_is_rejected_before_sending(step: object) -> None:
    with (
        ReductionClient(UNUSED_TARGET, job="j", group="g", rank=0, world_size=1) as client,
        pytest.raises(errors.UsageError, match=r"job 'j' group 'g' rank 0: step=.* must be an int"),
    ):
        client.reduce(step, {"pg": 1.0})  # type: ignore[arg-type]


def test_close_while_waiting_abandons_the_call(coordinator, wait_for_arrivals) -> None:
    settings = ClientSettings(call_timeout_s=30.0)
    client = ReductionClient(
        coordinator.target, job="j", group="g", rank=1, world_size=2, settings=settings
    )
    raised: list[BaseException] = []

    def wait_for_rank_0() -> None:
        try:
            client.reduce(3, {"pg": 1.0})
        except BaseException as exc:  # collected for the main thread to check
            raised.append(exc)

    waiter = threading.Thread(target=wait_for_rank_0)
    waiter.start()
    wait_for_arrivals(coordinator.target, "j", "g", 3, [1])
    client.close()
    waiter.join()
    (err,) = raised
    assert isinstance(err, ClientClosedError)
    assert str(err) == (
        "Step 3 was abandoned: the client for job 'j' rank 1 was closed while waiting for the round."
    )


def test_async_close_while_waiting_abandons_every_pipelined_call(
    coordinator, client_settings, wait_for_arrivals
) -> None:
    steps = (1, 2, 3)

    def all_arrived() -> None:
        for step in steps:
            wait_for_arrivals(coordinator.target, "j", "g", step, [0])

    async def scenario() -> list[BaseException | dict[str, float]]:
        client = AsyncReductionClient(
            coordinator.target, job="j", group="g", rank=0, world_size=2, settings=client_settings
        )
        calls = [asyncio.ensure_future(client.reduce(step, {"pg": 1.0})) for step in steps]
        await asyncio.to_thread(all_arrived)
        await client.close()
        return list(await asyncio.gather(*calls, return_exceptions=True))

    outcomes = asyncio.run(scenario())
    for step, err in zip(steps, outcomes, strict=True):
        assert isinstance(err, ClientClosedError)
        assert str(err).startswith(f"Step {step} was abandoned")


def test_sync_use_while_close_is_shutting_down_raises_closed_error() -> None:
    # close() marks the client stopped, then runs _shutdown on the loop, which
    # marks the async client CLOSED; calls in between must get the closed error.
    client = ReductionClient(UNUSED_TARGET, job="j", group="g", rank=1, world_size=2)
    shutdown = client._shutdown
    entered = threading.Event()
    release = threading.Event()

    async def held_shutdown() -> None:
        entered.set()
        await asyncio.to_thread(release.wait)
        await shutdown()

    client._shutdown = held_shutdown  # type: ignore[method-assign]
    closer = threading.Thread(target=client.close)
    closer.start()
    try:
        assert entered.wait(timeout=60), "close() never reached _shutdown"
        in_the_gap = client.state
        assert in_the_gap is not ClientState.CLOSED
        with pytest.raises(ClientClosedError) as info:
            client.reduce(3, {"pg": 1.0})
        assert str(info.value) == (
            "Cannot reduce step 3: the client for job 'j' rank 1 has been closed."
        )
        assert (info.value.job, info.value.group, info.value.step, info.value.rank) == (
            "j",
            "g",
            3,
            1,
        )
        with pytest.raises(ClientClosedError, match="Cannot open the client for job 'j' rank 1"):
            client.open()
    finally:
        release.set()
        closer.join()
    assert client.state is ClientState.CLOSED
