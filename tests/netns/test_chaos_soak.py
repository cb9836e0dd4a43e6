"""Chaos soak: 32 ranks on 4 nodes through their agents, hundreds of rounds, while
nodes and the coordinator's link are partitioned and healed at random moments, one
agent and the coordinator are SIGKILLed and restarted (the coordinator on its journal).

Every round must end one of two ways: completed with the exact expected
normalizers on every rank, or failed with the same error on every rank. A
round any other way (a rank without an answer in the bound, a wrong value, two
ranks told different things) is *lost*, and there must be none. The journal
must hold each round once, with the exact sums of the completed ones. The
bounded form runs in ``make test``; the long form is ``@pytest.mark.soak`` and
runs when ``LOSSREDUCE_SOAK=1``.
"""

from __future__ import annotations

import collections
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.netns import faults
from tests.netns.cluster import Cluster

ROUND_TIMEOUT_S = 3.0
SERVE = {**faults.SERVE, "round_timeout_s": ROUND_TIMEOUT_S}
# Budgets well above the longest fault (a restart: a few seconds on two shared cores),
# so every rank reaches the coordinator again and hears its round's one outcome.
RETRY = {**faults.RETRY, "retry_budget_s": 30.0, "call_timeout_s": 45.0}
AGENT = {**faults.AGENT, **RETRY}
STEP_BOUND_S = 90.0
"""No rank waits longer than this for one round, whatever the faults."""
STEP_PAUSE_S = 0.05
"""Between two rounds, as a trainer's forward and backward take (so faults land across rounds)."""
_REPORTED_TO = re.compile(r" \(reported to rank \d+ of \d+\)")


class Chaos:
    """Faults at random moments, one at a time, each healed (or restarted) before the next."""

    KINDS = ("partition_node", "partition_coordinator", "kill_agent", "kill_coordinator")
    WEIGHTS = (4, 2, 1, 1)

    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.injected: collections.Counter[str] = collections.Counter()
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the chaos thread did not stop"

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.rng.uniform(1.0, 3.0)):
                self._one(self.rng.choices(self.KINDS, self.WEIGHTS)[0])
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.errors.append(exc)

    def _one(self, kind: str) -> None:
        cluster, network = self.cluster, self.cluster.network
        self.injected[kind] += 1
        if kind == "partition_node":
            host = self.rng.choice(cluster.nodes).host
            network.partition(host)
            # Up to past the round timeout: some rounds then fail, and must fail alike.
            self._stop.wait(self.rng.uniform(0.3, 5.0))
            network.heal(host)
        elif kind == "partition_coordinator":
            network.partition(cluster.coordinator_host)
            self._stop.wait(self.rng.uniform(0.3, 4.0))
            network.heal(cluster.coordinator_host)
        elif kind == "kill_agent":
            cluster.restart_agent(cluster.nodes[-1])
        else:
            cluster.restart_coordinator()


def _verdict(cluster: Cluster, step: int, results: dict[int, dict[str, Any]]) -> str:
    """``completed``, ``failed`` (the same error everywhere) or ``lost``."""
    expected = cluster.expected(step)
    if all(r["ok"] and r["normalizers"] == expected for r in results.values()):
        return "completed"
    errors = {
        (r.get("error"), _REPORTED_TO.sub("", r.get("message", ""))) for r in results.values()
    }
    if len(errors) == 1 and not any(r["ok"] for r in results.values()):
        return "failed"
    return "lost"


def _soak(cluster_factory: Callable[..., Cluster], rounds: int, seed: int) -> None:
    cluster = cluster_factory(nodes=4, ranks_per_node=8, serve=SERVE, client=RETRY, agent=AGENT)
    chaos = Chaos(cluster, seed)
    verdicts: dict[int, str] = {}
    failures: collections.Counter[str] = collections.Counter()
    lost: dict[int, dict[int, dict[str, Any]]] = {}
    started = time.monotonic()
    chaos.start()
    try:
        for step in range(rounds):
            results = cluster.step(step, timeout_s=STEP_BOUND_S)
            verdicts[step] = _verdict(cluster, step, results)
            if verdicts[step] == "lost":
                lost[step] = results
            elif verdicts[step] == "failed":
                failures[next(iter(results.values()))["error"]] += 1
            time.sleep(STEP_PAUSE_S)
    finally:
        chaos.stop()
    elapsed = time.monotonic() - started
    assert not chaos.errors, chaos.errors
    journal = cluster.journal()
    counts = collections.Counter(verdicts.values())
    print(
        f"\nchaos soak: {cluster.world} ranks on {len(cluster.nodes)} nodes, {rounds} rounds in "
        f"{elapsed:.1f} s; faults injected {sum(chaos.injected.values())} "
        f"({dict(sorted(chaos.injected.items()))}); rounds completed {counts['completed']}, "
        f"failed cleanly {counts['failed']} ({dict(failures)}), lost {counts['lost']}; "
        f"coordinator starts "
        f"{cluster.coordinator.starts}, journal rounds {len(journal)}"
    )
    assert not lost, f"rounds lost: {lost}"
    assert sum(chaos.injected.values()) > 0
    assert counts["completed"] > rounds // 2
    # The journal agrees: every round once, completed ones exact, failed ones failed.
    faults.journal_exact(
        cluster,
        completed=[step for step, v in verdicts.items() if v == "completed"],
        failed=[step for step, v in verdicts.items() if v == "failed"],
    )


def test_chaos_soak_bounded(cluster_factory: Callable[..., Cluster]) -> None:
    _soak(cluster_factory, rounds=300, seed=1)


@pytest.mark.soak
@pytest.mark.skipif(
    os.environ.get("LOSSREDUCE_SOAK") != "1", reason="long chaos soak: set LOSSREDUCE_SOAK=1"
)
def test_chaos_soak_full(cluster_factory: Callable[..., Cluster]) -> None:
    _soak(cluster_factory, rounds=2000, seed=2)
