"""Silent partitions on a real network: no reset arrives, only keepalives and deadlines tell.

Each test builds its own namespaces (coordinator in one, each node's agent and
ranks in another), cuts links on the switch and checks the promises of
``docs/network-faults.md``: the healthy ranks get the round's timeout naming
the partitioned node's ranks, the partitioned ranks a clear error within the
bound their keepalive and retry settings imply, nothing hangs, a heal inside
the retry budget completes the round bit for bit, and the journal counts
every contribution once. Detection times are printed (``-s``) for that page.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.netns.cluster import Cluster
from tests.netns.faults import (
    AGENT,
    BUDGET_S,
    DETECT_S,
    KEEPALIVE,
    RETRY,
    ROUND_TIMEOUT_S,
    SERVE,
    SLACK_S,
    exact,
    journal_exact,
)


def test_node_partitioned_mid_round(cluster_factory: Callable[..., Cluster]) -> None:
    """Node n2 is cut off after its peers opened a round, for longer than the round
    timeout: its peers get the timeout naming its ranks, its ranks a clear error,
    and after the heal the next round completes, nothing counted twice."""
    cluster = cluster_factory(nodes=3, ranks_per_node=2, serve=SERVE, client=RETRY, agent=AGENT)
    exact(cluster, cluster.step(0), 0)
    cut = cluster.nodes[2]
    healthy = cluster.ranks(cluster.nodes[:2])
    cluster.send(1, healthy)
    opened = time.monotonic()
    time.sleep(0.3)
    cluster.network.partition(cut.host)
    cluster.send(1, cut.ranks)
    sent = time.monotonic()
    # Healthy ranks: the coordinator's own timeout, naming the missing ranks.
    peer_bound = ROUND_TIMEOUT_S + SLACK_S
    for _rank, line in cluster.collect(healthy, peer_bound + 5).items():
        assert line["error"] == "RoundTimeoutError", line
        assert "waiting for ranks [4, 5]" in line["message"], line["message"]
        assert line["seconds"] <= peer_bound, line
    peers_done = time.monotonic() - opened
    # Partitioned ranks: the agent declares the upstream dead (keepalive), spends its
    # retry budget, answers UNAVAILABLE naming the coordinator; each rank's client
    # retries that for its own budget (the agent's counts from the outage's start, so
    # each re-send gets one attempt), then raises.
    cut_bound = DETECT_S + 2 * BUDGET_S + SLACK_S
    cut_results = cluster.collect(list(cut.ranks), cut_bound + 10)
    cut_done = time.monotonic() - sent
    for line in cut_results.values():
        assert line["error"] == "CoordinatorUnavailableError", line
        assert cluster.coordinator_target in line["message"], line["message"]
        assert line["seconds"] <= cut_bound, line
    assert cut_done > ROUND_TIMEOUT_S  # the partition outlasted the round timeout
    cluster.network.heal(cut.host)
    exact(cluster, cluster.step(2, timeout_s=30), 2)
    journal_exact(cluster, completed=[0, 2], failed=[1])
    journal = cluster.journal()
    assert "waiting for ranks [4, 5]" in str(journal[1].error)
    print(
        f"\nnode partition: healthy ranks failed {peers_done:.2f} s after the round opened "
        f"(round timeout {ROUND_TIMEOUT_S:g} s); partitioned ranks "
        f"after {[round(r['seconds'], 2) for r in cut_results.values()]} s "
        f"(bound {cut_bound:g} s)"
    )


def test_agent_partition_healed_inside_the_retry_budget(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """n1's agent has sent its contribution when its link goes quiet; the round then
    completes without it hearing. Healed inside the retry budget, the agent reconnects,
    re-sends, and its ranks get the same normalizers bit for bit; the journal holds
    the round once, and the coordinator answered the re-send as a retry."""
    budget = 20.0
    cluster = cluster_factory(
        nodes=2,
        ranks_per_node=2,
        serve={**SERVE, "round_timeout_s": 30.0},
        client={**RETRY, "retry_budget_s": budget},
        agent={**AGENT, "retry_budget_s": budget},
    )
    exact(cluster, cluster.step(0), 0)
    before = cluster.metric("lossreduce_contributions_total", job=cluster.job)
    cut = cluster.nodes[1]
    cluster.send(1, cut.ranks)
    deadline = time.monotonic() + 10
    while cluster.metric("lossreduce_contributions_total", job=cluster.job) == before:
        assert time.monotonic() < deadline, "n1's contribution did not reach the coordinator"
        time.sleep(0.1)
    cluster.network.partition(cut.host)
    cut_at = time.monotonic()
    exact(cluster, cluster.step(1, cluster.ranks(cluster.nodes[:1])), 1)
    time.sleep(DETECT_S + 1.0)  # long enough for the agent to declare its stream dead
    cluster.network.heal(cut.host)
    healed_at = time.monotonic()
    results = cluster.collect(list(cut.ranks), budget + 10)
    exact(cluster, results, 1)
    after_heal = time.monotonic() - healed_at
    assert cluster.metric("lossreduce_retries_deduplicated_total", job=cluster.job) >= 1
    exact(cluster, cluster.step(2), 2)
    journal_exact(cluster, completed=[0, 1, 2], failed=[])
    print(
        f"\nagent partition healed after {healed_at - cut_at:.2f} s: its ranks answered "
        f"{after_heal:.2f} s after the heal, in {[round(r['seconds'], 2) for r in results.values()]} s"
    )


@pytest.mark.parametrize("via_agents", [False, True], ids=["direct", "agents"])
def test_coordinator_partitioned_while_ranks_wait(
    cluster_factory: Callable[..., Cluster], via_agents: bool
) -> None:
    """The coordinator's link goes quiet while ranks wait in a round: every rank fails
    within the bound of its settings, naming the coordinator's address; none waits on."""
    cluster = cluster_factory(
        nodes=2,
        ranks_per_node=2,
        serve={**SERVE, "round_timeout_s": 60.0},
        client={**RETRY, **KEEPALIVE} if not via_agents else RETRY,
        agent=AGENT if via_agents else None,
    )
    exact(cluster, cluster.step(0), 0)
    waiting = cluster.ranks()[:-1]  # the last rank never comes: the round stays open
    cluster.send(1, waiting)
    time.sleep(0.5)
    cluster.network.partition(cluster.coordinator_host)
    cut_at = time.monotonic()
    bound = DETECT_S + (2 if via_agents else 1) * BUDGET_S + SLACK_S
    results = cluster.collect(waiting, bound + 10)
    for line in results.values():
        assert line["error"] == "CoordinatorUnavailableError", line
        assert cluster.coordinator_target in line["message"], line["message"]
    elapsed = time.monotonic() - cut_at
    assert elapsed <= bound, f"ranks failed {elapsed:.1f} s after the partition (bound {bound})"
    print(
        f"\ncoordinator partition ({'agents' if via_agents else 'direct'}): ranks failed "
        f"{[round(r['seconds'] - 0.5, 2) for r in results.values()]} s after it (bound {bound:g} s)"
    )
