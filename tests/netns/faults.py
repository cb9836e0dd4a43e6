"""What the network-fault tests share: scaled-down settings, and the checks they make.

The settings scale the defaults' keepalive (10 s + 5 s) down to 1 s + 1 s and
the retry budgets down to 3 s so the tests stay short; each test asserts the
bound these imply, by the formulas of ``docs/network-faults.md``, plus
:data:`SLACK_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.netns.cluster import COORDINATOR_PORT, Cluster
from tests.netns.harness import Host

ROUND_TIMEOUT_S = 4.0
KEEPALIVE = {"keepalive_time_s": 1.0, "keepalive_timeout_s": 1.0}
"""Short keepalives (the defaults' detection scaled down so the tests stay short)."""
SERVE = {
    "round_timeout_s": ROUND_TIMEOUT_S,
    "shutdown_grace_s": 0.5,
    "keepalive_min_ping_interval_s": 0.5,
    **KEEPALIVE,
}
BUDGET_S = 3.0
RETRY = {"retry_budget_s": BUDGET_S, "max_backoff_s": 0.5, "call_timeout_s": 30.0}
AGENT = {**KEEPALIVE, **RETRY, "node_timeout_s": 2.0}
"""The agents' upstream settings; their ranks dial them on the node's loopback."""
DETECT_S = KEEPALIVE["keepalive_time_s"] + KEEPALIVE["keepalive_timeout_s"]
"""A silent connection is declared dead within one ping interval plus its timeout."""
SLACK_S = 3.0
"""Scheduling on two shared cores, process wake-ups, one backoff step."""


def exact(cluster: Cluster, results: dict[int, dict[str, Any]], step: int) -> None:
    expected = cluster.expected(step)
    for rank, line in results.items():
        assert line["ok"], f"rank {rank} step {step}: {line}"
        assert line["normalizers"] == expected, f"rank {rank} step {step}"


def journal_exact(cluster: Cluster, completed: list[int], failed: list[int]) -> None:
    """The journal holds each round once: completed ones with the exact sums and every
    rank's contribution digest (each rank counted once), failed ones with their error."""
    journal = cluster.journal()
    assert sorted(journal) == sorted(completed + failed)
    for step in completed:
        outcome = journal[step]
        assert outcome.error is None, f"step {step}: {outcome.error}"
        values = {n.term: n.value.hex() for n in outcome.normalizers}
        assert values == cluster.expected(step), f"step {step}"
        assert outcome.record is not None
        assert all(outcome.record.digest_of(r) for r in range(cluster.world)), step
    for step in failed:
        assert journal[step].error is not None, f"step {step} should have failed"


def served(coord: Host, peer: Host) -> list[str]:
    """The coordinator's connections from ``peer``."""
    return [
        c
        for c in coord.connections(sport=COORDINATOR_PORT)
        if c.split("->")[1].startswith(peer.address + ":")
    ]


def dialed(host: Host) -> list[str]:
    """``host``'s connections to the coordinator."""
    return host.connections(dport=COORDINATOR_PORT)


def until_gone(*probes: Callable[[], list[str]], timeout_s: float) -> list[float]:
    """Seconds until each probe lists nothing (polled together); fails after ``timeout_s``."""
    started = time.monotonic()
    gone: list[float | None] = [None] * len(probes)
    while None in gone:
        now = time.monotonic() - started
        assert now < timeout_s, f"still there: {[p() for p in probes]}"
        for i, probe in enumerate(probes):
            if gone[i] is None and not probe():
                gone[i] = now
        time.sleep(0.05)
    return [g for g in gone if g is not None]
