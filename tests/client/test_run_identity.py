"""The run on the wire: every request a client, a node aggregator or an agent
sends names its run, and a round reports the run that opened it."""

from __future__ import annotations

import asyncio

import grpc

from lossreduce.client import ClientSettings, ReductionClient, RoundResult
from lossreduce.client.aggregator import AggregatorSettings, NodeAggregator, node_requests
from lossreduce.contribution import Contribution
from lossreduce.errors import EmptyNormalizerError
from lossreduce.server import CoordinatorThread
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc
from tests.client.conftest import RoundRunner

KEY = pb.RoundKey(job="job-r", group="actor", step=3)


def round_run(target: str, job: str, group: str, step: int) -> str:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        key = pb.RoundKey(job=job, group=group, step=step)
        status = stub.GetRound(pb.GetRoundRequest(round=key), timeout=10.0)
    assert status.state == pb.ROUND_STATE_COMPLETED, status
    return str(status.run)


def one(rank: int, value: float, run: str) -> Contribution:
    return Contribution(rank, 4, ("pg",), (value,), ("",), run=run)


def test_a_contribution_keeps_its_run_across_the_wire() -> None:
    c = one(2, 1.5, "run-a")
    request = c.request(KEY)
    assert request.run == "run-a"
    assert Contribution.from_request(request) == c
    legacy = Contribution.from_request(one(2, 1.5, "").request(KEY))
    assert legacy.run == ""


def test_a_node_aggregate_names_the_run_its_ranks_share() -> None:
    (aggregate,) = node_requests(KEY, [one(0, 1.0, "run-a"), one(1, 2.0, "run-a")])
    assert list(aggregate.covered_ranks) == [0, 1]
    assert aggregate.run == "run-a"


def test_ranks_of_different_runs_go_up_alone_each_naming_its_own() -> None:
    requests = node_requests(KEY, [one(0, 1.0, "run-a"), one(1, 2.0, "run-b")])
    assert [(r.rank, list(r.covered_ranks), r.run) for r in requests] == [
        (0, [], "run-a"),
        (1, [], "run-b"),
    ]


def test_every_request_of_a_client_names_its_run(
    coordinator: CoordinatorThread, reduce_round: RoundRunner, client_settings: ClientSettings
) -> None:
    """Over the stream and over unary calls: the round the run's ranks opened
    reports that run."""
    outcomes = reduce_round("job-r", [{"pg": 1.0}, {"pg": 2.0}], run="run-a", step=4)
    assert all(isinstance(o, RoundResult) for o in outcomes), outcomes
    assert round_run(coordinator.target, "job-r", "actor", 4) == "run-a"


def test_the_sync_client_exposes_its_run(coordinator: CoordinatorThread) -> None:
    with ReductionClient(
        coordinator.target, job="job-s", group="actor", rank=0, world_size=1, run="run-s"
    ) as client:
        assert client.run == "run-s"
        assert client.reduce(1, {"pg": 3.0}) == {"pg": 3.0}
    assert round_run(coordinator.target, "job-s", "actor", 1) == "run-s"
    with ReductionClient(
        coordinator.target, job="job-s", group="old", rank=0, world_size=1
    ) as legacy:
        assert legacy.run == ""
        assert legacy.reduce(1, {"pg": 3.0}) == {"pg": 3.0}
    assert round_run(coordinator.target, "job-s", "old", 1) == ""


def test_a_node_aggregator_sends_its_run_for_its_local_ranks(
    coordinator: CoordinatorThread,
) -> None:
    async def main() -> list[dict[str, float]]:
        async with NodeAggregator(
            coordinator.target,
            job="job-n",
            group="actor",
            local_ranks=(0, 1),
            world_size=2,
            settings=AggregatorSettings(node_timeout_s=30.0),
            run="run-n",
        ) as node:
            return list(
                await asyncio.gather(
                    node.local_rank(0).reduce(5, {"pg": 1.0}),
                    node.local_rank(1).reduce(5, {"pg": 2.0}),
                )
            )

    assert asyncio.run(main()) == [{"pg": 3.0}, {"pg": 3.0}]
    assert round_run(coordinator.target, "job-n", "actor", 5) == "run-n"


def test_a_round_error_names_the_run(
    reduce_round: RoundRunner, client_settings: ClientSettings
) -> None:
    outcomes = reduce_round("job-e", [{"pg": 0.0}, {"pg": 0.0}], run="run-e", step=2)
    for outcome in outcomes:
        assert isinstance(outcome, EmptyNormalizerError), outcome
        assert outcome.run == "run-e"
        assert str(outcome).endswith("[run 'run-e']"), str(outcome)
