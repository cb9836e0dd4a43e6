"""The shipped keepalive defaults against a silent partition (``docs/network-faults.md``).

Client and coordinator run with their default keepalive settings (only the
retry budget is shortened, so the test ends soon after detection): a node
cut off while its rank waits in a round is noticed by both ends within
``keepalive_time_s + keepalive_timeout_s``, and a healthy idle client on the
other node keeps its one connection meanwhile (the default ping rate is
within the coordinator's default ping policy).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lossreduce.client import ClientSettings
from lossreduce.client.agent import AgentSettings
from lossreduce.client.agent_service import server_options
from lossreduce.server import CoordinatorSettings
from tests.netns.cluster import Cluster
from tests.netns.faults import SLACK_S, dialed, exact, served, until_gone

CLIENT = ClientSettings()
SERVER = CoordinatorSettings()
CLIENT_DETECT_S = CLIENT.keepalive_time_s + CLIENT.keepalive_timeout_s
SERVER_DETECT_S = SERVER.keepalive_time_s + SERVER.keepalive_timeout_s


def test_default_keepalives_detect_a_silent_partition_within_seconds(
    cluster_factory: Callable[..., Cluster],
) -> None:
    budget_s = 2.0
    cluster = cluster_factory(
        nodes=2,
        ranks_per_node=1,
        serve={"round_timeout_s": 60.0, "shutdown_grace_s": 0.5},
        client={"retry_budget_s": budget_s},
        agent=None,
    )
    cut, healthy = cluster.nodes[0].host, cluster.nodes[1].host
    coord = cluster.coordinator_host
    exact(cluster, cluster.step(0), 0)
    (idle,) = dialed(healthy)
    cluster.send(1, [0])
    time.sleep(0.5)
    cluster.network.partition(cut)
    bound = max(CLIENT_DETECT_S, SERVER_DETECT_S) + SLACK_S
    server_s, client_s = until_gone(
        lambda: served(coord, cut), lambda: dialed(cut), timeout_s=bound
    )
    (line,) = cluster.collect([0], CLIENT_DETECT_S + budget_s + SLACK_S).values()
    assert line["error"] == "CoordinatorUnavailableError", line
    assert cluster.coordinator_target in line["message"]
    assert dialed(healthy) == [idle], "the healthy idle client lost its connection"
    cluster.network.heal(cut)
    exact(cluster, cluster.step(2), 2)
    print(
        f"\ndefault keepalives: the coordinator dropped the silent client after {server_s:.2f} s "
        f"(bound {SERVER_DETECT_S:g} s), the client its connection after {client_s:.2f} s "
        f"(bound {CLIENT_DETECT_S:g} s); its waiting rank failed after {line['seconds'] - 0.5:.2f} s"
    )


def test_default_ping_rates_are_within_every_ping_policy() -> None:
    """A client pings at twice the shortest interval the coordinator, and an agent toward
    its ranks, tolerate (the ratio the network test above shows to be safe); the
    coordinator's own pings and timeouts detect a silent client as fast as a client does."""
    agent_min_s = dict(server_options(AgentSettings()))[
        "grpc.http2.min_ping_interval_without_data_ms"
    ]
    assert CLIENT.keepalive_time_s >= 2 * SERVER.keepalive_min_ping_interval_s
    assert CLIENT.keepalive_time_s * 1000 >= 2 * agent_min_s
    assert AgentSettings().keepalive_time_s == CLIENT.keepalive_time_s
    assert SERVER_DETECT_S <= CLIENT_DETECT_S <= 15.0
