"""Non-blocking rounds: reduce_start() and its PendingReduction / asyncio task."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading

import pytest

from lossreduce.client import (
    AsyncReductionClient,
    ClientClosedError,
    ClientSettings,
    InvalidPartialError,
    LossReduceError,
    PendingReduction,
    ReductionClient,
    RoundAbortedError,
)


def _client(target: str, settings: ClientSettings, rank: int, world_size: int, job: str = "j"):
    return ReductionClient(
        target, job=job, group="g", rank=rank, world_size=world_size, settings=settings
    )


def test_start_then_result_is_reduce(coordinator, client_settings) -> None:
    with _client(coordinator.target, client_settings, 0, 1) as client:
        pending = client.reduce_start(1, {"pg": 3.0, "kl": 5.0})
        assert isinstance(pending, PendingReduction)
        assert pending.result() == {"pg": 3.0, "kl": 5.0}
        assert pending.done()
        assert pending.result(timeout=0) == {"pg": 3.0, "kl": 5.0}  # idempotent
        assert not pending.cancel()  # already over
        assert client.reduce(2, {"pg": 3.0, "kl": 5.0}) == pending.result()


def test_result_times_out_while_the_round_waits_then_completes(
    coordinator, client_settings, wait_for_arrivals
) -> None:
    with (
        _client(coordinator.target, client_settings, 0, 2) as rank0,
        _client(coordinator.target, client_settings, 1, 2) as rank1,
    ):
        pending = rank0.reduce_start(1, {"pg": 2.0})
        wait_for_arrivals(coordinator.target, "j", "g", 1, [0])
        assert not pending.done()
        with pytest.raises(TimeoutError, match="job 'j' group 'g' step 1 rank 0"):
            pending.result(timeout=0.05)
        assert rank1.reduce(1, {"pg": 6.0}) == {"pg": 8.0}
        assert pending.result() == {"pg": 8.0}


def test_a_failing_round_raises_on_every_rank_every_time(coordinator, client_settings) -> None:
    with (
        _client(coordinator.target, client_settings, 0, 2) as rank0,
        _client(coordinator.target, client_settings, 1, 2) as rank1,
    ):
        culprit = rank0.reduce_start(1, {"pg": math.nan})
        peer = rank1.reduce_start(1, {"pg": 1.0})
        for _ in range(2):
            with pytest.raises(InvalidPartialError) as mine:
                culprit.result()
            with pytest.raises(RoundAbortedError) as theirs:
                peer.result()
            assert (mine.value.step, mine.value.rank) == (1, 0)
            assert theirs.value.ranks == (0,)
            assert "rank 0" in str(theirs.value)


def test_a_malformed_partial_is_sent_as_nan_and_named(coordinator, client_settings) -> None:
    with (
        _client(coordinator.target, client_settings, 0, 2) as rank0,
        _client(coordinator.target, client_settings, 1, 2) as rank1,
    ):
        culprit = rank0.reduce_start(1, {"pg": "three"})
        with pytest.raises(RoundAbortedError):
            rank1.reduce(1, {"pg": 1.0})
        with pytest.raises(InvalidPartialError, match="not a number"):
            culprit.result()


def test_close_while_in_flight_raises_closed_error(
    coordinator, client_settings, wait_for_arrivals
) -> None:
    client = _client(coordinator.target, client_settings, 0, 2)
    pending = client.reduce_start(3, {"pg": 1.0})
    wait_for_arrivals(coordinator.target, "j", "g", 3, [0])
    client.close()
    for _ in range(2):
        with pytest.raises(ClientClosedError, match="Step 3 was abandoned"):
            pending.result()
    assert pending.done()
    with pytest.raises(ClientClosedError, match="Cannot reduce step 4"):
        client.reduce_start(4, {"pg": 1.0})


def test_two_outstanding_steps_are_matched_to_their_answers(coordinator, client_settings) -> None:
    with (
        _client(coordinator.target, client_settings, 0, 2) as rank0,
        _client(coordinator.target, client_settings, 1, 2) as rank1,
    ):
        first = rank0.reduce_start(1, {"pg": 1.0})
        second = rank0.reduce_start(2, {"pg": 10.0})
        peer = rank1.reduce_start(2, {"pg": 20.0})
        assert rank1.reduce(1, {"pg": 2.0}) == {"pg": 3.0}
        assert second.result() == {"pg": 30.0}
        assert first.result() == {"pg": 3.0}
        assert peer.result() == {"pg": 30.0}


def test_cancel_stops_waiting_and_the_client_keeps_working(
    coordinator, client_settings, wait_for_arrivals
) -> None:
    with (
        _client(coordinator.target, client_settings, 0, 2) as rank0,
        _client(coordinator.target, client_settings, 1, 2) as rank1,
    ):
        pending = rank0.reduce_start(1, {"pg": 1.0})
        wait_for_arrivals(coordinator.target, "j", "g", 1, [0])
        assert pending.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            pending.result()
        # The contribution still counts for the peer; later rounds work.
        assert rank1.reduce(1, {"pg": 2.0}) == {"pg": 3.0}
        again = rank0.reduce_start(2, {"pg": 1.0})
        assert rank1.reduce(2, {"pg": 4.0}) == {"pg": 5.0}
        assert again.result() == {"pg": 5.0}


def test_threads_start_and_wait_on_one_client(coordinator, client_settings) -> None:
    world = 2
    steps_per_thread = 10
    threads_per_rank = 3
    clients = [_client(coordinator.target, client_settings, r, world) for r in range(world)]
    failures: list[BaseException] = []

    def work(client: ReductionClient, first: int) -> None:
        try:
            for step in range(first, first + steps_per_thread):
                pending = client.reduce_start(step, {"pg": float(client.rank + 1)})
                if step % 2:
                    assert client.reduce(step + 1000, {"pg": 1.0}) == {"pg": 2.0}
                assert pending.result() == {"pg": 3.0}
        except BaseException as exc:  # collected for the main thread to check
            failures.append(exc)

    threads = [
        threading.Thread(target=work, args=(client, t * steps_per_thread))
        for client in clients
        for t in range(threads_per_rank)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for client in clients:
            client.close()
    assert failures == []
    assert not any(thread.is_alive() for thread in threads)


def test_async_reduce_start_is_a_task_of_reduce(coordinator, client_settings) -> None:
    async def scenario() -> tuple[dict[str, float], BaseException | None]:
        async with (
            AsyncReductionClient(
                coordinator.target,
                job="j",
                group="g",
                rank=0,
                world_size=2,
                settings=client_settings,
            ) as rank0,
            AsyncReductionClient(
                coordinator.target,
                job="j",
                group="g",
                rank=1,
                world_size=2,
                settings=client_settings,
            ) as rank1,
        ):
            good = rank0.reduce_start(1, {"pg": 1.0})
            assert isinstance(good, asyncio.Task)
            assert await rank1.reduce(1, {"pg": 2.0}) == {"pg": 3.0}
            bad = rank0.reduce_start(2, {"pg": -1.0})
            with pytest.raises(RoundAbortedError):
                await rank1.reduce(2, {"pg": 2.0})
            try:
                await bad
            except LossReduceError as err:
                return await good, err
            return await good, None

    normalizers, err = asyncio.run(scenario())
    assert normalizers == {"pg": 3.0}
    assert isinstance(err, InvalidPartialError)
