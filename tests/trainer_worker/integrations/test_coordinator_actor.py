"""Ranks of a framework's job start or join the job's coordinator actor (``join_coordinator_actor``).

Real Ray: ranks are Ray actors that each call ``join_coordinator_actor`` at the
same moment, then reduce through the endpoint they got; on two raylets the
coordinator listens beyond loopback, over the run's own TLS.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from pydantic import SecretStr

from lossreduce.client import ClientSettings, ReductionClient
from lossreduce.errors import CoordinatorUnavailableError, UsageError
from lossreduce.ports import LOOPBACK
from lossreduce.trainer_worker.integrations.coordinator_actor import (
    CoordinatorEndpoint,
    join_coordinator_actor,
)
from tests.ray_support import local_ray
from tests.trainer_worker.train.multinode_harness import local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


class Rank:
    """One rank of a job: joins the job's coordinator, then reduces its value."""

    def join(self, job: str) -> CoordinatorEndpoint:
        self.joined = join_coordinator_actor(job, round_timeout_s=20.0, startup_timeout_s=60.0)
        self.endpoint = self.joined.endpoint
        return self.endpoint

    def reduce(self, job: str, rank: int, world: int, value: float) -> dict[str, float]:
        settings = ClientSettings(
            call_timeout_s=30.0,
            token=self.endpoint.token,
            tls_root_cert_pem=self.endpoint.ca_cert,
        )
        with ReductionClient(
            self.endpoint.target,
            job=job,
            group="actor",
            rank=rank,
            world_size=world,
            settings=settings,
        ) as client:
            return client.reduce(0, {"pg": value})

    def reduce_without_token(self, job: str) -> str:
        settings = ClientSettings(
            call_timeout_s=10.0, retry_budget_s=0.0, tls_root_cert_pem=self.endpoint.ca_cert
        )
        try:
            with ReductionClient(
                self.endpoint.target,
                job=job,
                group="actor",
                rank=0,
                world_size=1,
                settings=settings,
            ) as client:
                client.reduce(0, {"pg": 1.0})
        except Exception as err:
            return type(err).__name__
        return "accepted"


def _ranks(count: int, strategy: str = "DEFAULT") -> list[ray.actor.ActorHandle]:
    cls = ray.remote(num_cpus=0.1, scheduling_strategy=strategy)(Rank)
    return [cls.remote() for _ in range(count)]


@pytest.fixture(scope="module")
def one_node() -> Iterator[None]:
    with local_ray():
        yield


def test_every_rank_joins_one_coordinator_with_one_fresh_token(one_node: None) -> None:
    ranks = _ranks(3)
    endpoints = ray.get([r.join.remote("join-one") for r in ranks], timeout=120)
    assert len({(e.target, e.token.get_secret_value()) for e in endpoints}) == 1
    endpoint = endpoints[0]
    assert endpoint.target.startswith(f"{LOOPBACK}:")
    assert endpoint.ca_cert is None  # one node: plaintext on loopback
    assert len(endpoint.token.get_secret_value()) >= 32
    totals = ray.get(
        [r.reduce.remote("join-one", i, 3, float(i + 1)) for i, r in enumerate(ranks)],
        timeout=120,
    )
    assert totals == [{"pg": 6.0}] * 3
    assert ray.get(ranks[0].reduce_without_token.remote("join-one"), timeout=60) == (
        "AuthenticationError"
    )
    # Another job gets a coordinator and a token of its own.
    (other,) = ray.get([_ranks(1)[0].join.remote("join-two")], timeout=120)
    assert other.target != endpoint.target
    assert other.token.get_secret_value() != endpoint.token.get_secret_value()


def test_outside_a_ray_cluster_the_address_is_asked_for() -> None:
    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(UsageError, match=r"job 'lone'.*not connected to one.*coordinator=HOST"):
        join_coordinator_actor("lone", round_timeout_s=5.0, startup_timeout_s=5.0)


def test_on_two_nodes_the_joined_coordinator_serves_over_the_runs_tls() -> None:
    with local_cluster(nodes=2):
        ranks = _ranks(2, strategy="SPREAD")
        endpoints = ray.get([r.join.remote("join-tls") for r in ranks], timeout=120)
        assert endpoints[0] == endpoints[1]
        endpoint = endpoints[0]
        assert endpoint.ca_cert is not None
        assert b"BEGIN CERTIFICATE" in endpoint.ca_cert
        assert not endpoint.target.startswith(f"{LOOPBACK}:")
        totals = ray.get(
            [r.reduce.remote("join-tls", i, 2, 2.0**i) for i, r in enumerate(ranks)], timeout=120
        )
        assert totals == [{"pg": 3.0}] * 2
        # Plaintext is refused: the token never crosses the network in clear.
        plain = ClientSettings(call_timeout_s=5.0, retry_budget_s=0.0, token=SecretStr("x"))
        with (
            pytest.raises(CoordinatorUnavailableError),
            ReductionClient(
                endpoint.target, job="join-tls", group="actor", rank=0, world_size=1, settings=plain
            ) as client,
        ):
            client.reduce(1, {"pg": 1.0})
