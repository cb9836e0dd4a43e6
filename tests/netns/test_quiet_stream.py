"""A stream that goes quiet without a reset, seen from both ends; and the ping policy.

Ranks dial the coordinator directly here (no agent), each on its own
connection, so each end's keepalive is observable in the kernel's socket
table (``ss`` inside each namespace): the coordinator releases a silent
client's connection and its round slot, the client drops its silent
connection and retries on a new one, and a healthy idle client pinging at
the coordinator's allowed rate keeps its connection for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.netns.cluster import Cluster
from tests.netns.faults import (
    DETECT_S,
    KEEPALIVE,
    RETRY,
    SERVE,
    SLACK_S,
    dialed,
    exact,
    served,
    until_gone,
)


def test_quiet_stream_released_on_both_sides(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(
        nodes=2,
        ranks_per_node=1,
        # One round slot: a slot the quiet stream leaked would refuse the next round.
        serve={**SERVE, "max_rounds_in_flight": 1},
        client={**RETRY, **KEEPALIVE, "retry_budget_s": 20.0},
        agent=None,
    )
    quiet = cluster.nodes[1].host
    coord = cluster.coordinator_host
    exact(cluster, cluster.step(0), 0)
    (old,) = served(coord, quiet)
    baseline = cluster.metric("lossreduce_rounds_in_flight")

    # An idle stream goes quiet while its peer's round waits for it.
    cluster.send(1, [0])
    time.sleep(0.3)
    cluster.network.partition(quiet)
    server_s, client_s = until_gone(
        lambda: served(coord, quiet), lambda: dialed(quiet), timeout_s=DETECT_S + SLACK_S
    )
    (timed_out,) = cluster.collect([0], SERVE["round_timeout_s"] + SLACK_S).values()
    assert timed_out["error"] == "RoundTimeoutError", timed_out
    assert "waiting for ranks [1]" in timed_out["message"]
    assert cluster.metric("lossreduce_rounds_in_flight") == baseline == 0
    cluster.network.heal(quiet)
    exact(cluster, cluster.step(2), 2)
    (new,) = served(coord, quiet)
    assert new != old, "the client must have come back on a new connection"

    # A call in flight when its stream goes quiet: retried on a new connection.
    cluster.send(3, [1])
    time.sleep(0.3)
    cluster.network.partition(quiet)
    (in_flight_s,) = until_gone(lambda: dialed(quiet), timeout_s=DETECT_S + SLACK_S)
    cluster.network.heal(quiet)
    exact(cluster, cluster.step(3, [0]) | cluster.collect([1], 30.0), 3)
    (again,) = served(coord, quiet)
    assert again not in (old, new)
    assert cluster.metric("lossreduce_rounds_in_flight") == 0
    journal = cluster.journal()
    assert sorted(journal) == [0, 1, 2, 3]
    assert journal[1].error is not None
    print(
        f"\nquiet stream: the coordinator dropped it after {server_s:.2f} s, the idle client "
        f"after {client_s:.2f} s, the client with a call in flight after {in_flight_s:.2f} s "
        f"(keepalive {KEEPALIVE['keepalive_time_s']:g} s + {KEEPALIVE['keepalive_timeout_s']:g} s)"
    )


def _idle_connection_survives(
    cluster_factory: Callable[..., Cluster], client_ping_s: float, server_min_s: float
) -> bool:
    cluster = cluster_factory(
        nodes=1,
        ranks_per_node=1,
        serve={**SERVE, "keepalive_min_ping_interval_s": server_min_s, "keepalive_time_s": 30.0},
        client={**RETRY, "keepalive_time_s": client_ping_s, "keepalive_timeout_s": 1.0},
        agent=None,
    )
    host = cluster.nodes[0].host
    exact(cluster, cluster.step(0), 0)
    (before,) = dialed(host)
    time.sleep(max(8 * client_ping_s, 4.0))  # idle: only pings cross the connection
    exact(cluster, cluster.step(1), 1)
    return dialed(host) == [before]


def test_ping_policy_keeps_a_healthy_idle_client(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """A client pinging its idle stream at twice the coordinator's shortest allowed
    interval (the defaults' ratio) keeps its one connection."""
    assert _idle_connection_survives(cluster_factory, client_ping_s=1.0, server_min_s=0.5)


def test_ping_policy_tears_down_a_client_pinging_too_often(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """The control: pinging faster than the coordinator allows costs the connection
    (GOAWAY too_many_pings), so the test above can tell."""
    assert not _idle_connection_survives(cluster_factory, client_ping_s=0.2, server_min_s=2.0)
