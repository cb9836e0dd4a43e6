"""Helpers for the client tests: run whole rounds from the client side.

Built on the root fixtures (``coordinator``, ``coordinator_factory``,
``free_port``). ``client_settings`` is parametrized over both transports, so
every test that uses it runs once over ReduceStream and once over unary Reduce.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import pytest

from lossreduce.client import (
    AsyncReductionClient,
    ClientSettings,
    LossReduceError,
    PartialValue,
    RoundResult,
)
from lossreduce.server import CoordinatorThread
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

Outcome = RoundResult | LossReduceError


RoundRunner = Callable[..., list[Outcome]]


@pytest.fixture
def coordinator(
    request: pytest.FixtureRequest, coordinator_factory: Callable[..., CoordinatorThread]
) -> CoordinatorThread:
    """The root ``coordinator`` (same indirect overrides), without /metrics: the
    client never scrapes it, and stopping the metrics server costs each test
    half a second."""
    overrides: dict[str, object] = {"metrics_port": None, **getattr(request, "param", {})}
    return coordinator_factory(**overrides)


@pytest.fixture(params=["stream", "unary"])
def client_settings(request: pytest.FixtureRequest) -> ClientSettings:
    # Short backoff for tests; the deadline still bounds every call.
    return ClientSettings(
        use_stream=request.param == "stream",
        retry_budget_s=2.0,
        initial_backoff_s=0.02,
        max_backoff_s=0.2,
        call_timeout_s=30.0,
    )


def run_round(
    target: str,
    job: str,
    partials: Sequence[Mapping[str, PartialValue]],
    *,
    settings: ClientSettings,
    contracts: Sequence[Mapping[str, str] | None] | None = None,
    ranks: Sequence[int] | None = None,
    world_sizes: Sequence[int] | None = None,
    step: int = 1,
    group: str = "actor",
    run: str = "",
) -> list[Outcome]:
    """One client per entry of ``partials``, all concurrently; one outcome each.

    Entry ``i`` is rank ``ranks[i]`` (default ``i``) of ``world_sizes[i]``
    (default ``len(partials)``) sending ``contracts[i]`` (default none), every
    request naming ``run`` (default none).
    """

    async def one(i: int) -> Outcome:
        async with AsyncReductionClient(
            target,
            job=job,
            group=group,
            rank=i if ranks is None else ranks[i],
            world_size=len(partials) if world_sizes is None else world_sizes[i],
            settings=settings,
            run=run,
        ) as client:
            try:
                return await client.reduce_detailed(
                    step, partials[i], None if contracts is None else contracts[i]
                )
            except LossReduceError as err:
                return err

    async def every_rank() -> list[Outcome]:
        return list(await asyncio.gather(*(one(i) for i in range(len(partials)))))

    return asyncio.run(every_rank())


@pytest.fixture
def reduce_round(coordinator: CoordinatorThread, client_settings: ClientSettings) -> RoundRunner:
    """``reduce_round(job, partials, ...)``: :func:`run_round` against ``coordinator``."""
    return functools.partial(run_round, coordinator.target, settings=client_settings)


def wait_for_arrivals(target: str, job: str, group: str, step: int, ranks: Sequence[int]) -> None:
    """Block until the coordinator has seen ``ranks`` in the round (bounded, 20 s)."""
    key = pb.RoundKey(job=job, group=group, step=step)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            status = stub.GetRound(pb.GetRoundRequest(round=key), timeout=5.0)
            if set(ranks) <= set(status.arrived_ranks):
                return
            time.sleep(0.01)
    raise AssertionError(f"ranks {list(ranks)} never arrived in {key}")


@pytest.fixture(name="wait_for_arrivals")
def wait_for_arrivals_fixture() -> Callable[[str, str, str, int, Sequence[int]], None]:
    return wait_for_arrivals


def assert_names_round(err: LossReduceError, job: str, step: int, rank: int) -> None:
    """The exception carries, and its message names, the job, group, step and rank."""
    assert (err.job, err.group, err.step, err.rank) == (job, "actor", step, rank)
    message = str(err)
    assert f"job {job!r} group 'actor' step {step}" in message
    assert f"rank {rank}" in message


@pytest.fixture(name="assert_names_round")
def assert_names_round_fixture() -> Callable[[LossReduceError, str, int, int], None]:
    return assert_names_round
