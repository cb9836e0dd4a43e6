"""A training cluster on a :class:`~tests.netns.harness.Network`.

- the coordinator: ``lossreduce serve`` with a journal, in host ``coord``,
  listening on its namespace address;
- per node ``n<i>``: ``lossreduce agent`` (upstream: the coordinator's
  address; ranks dial it on the node's loopback) and one
  :mod:`tests.netns.rank_host` process holding the node's ranks' clients; or,
  without agents, the ranks' clients dial the coordinator directly.

:meth:`Cluster.step` sends one step to chosen ranks and collects their result
lines within a bound; :meth:`Cluster.expected` is the exact answer
(``math.fsum`` in rank order of :func:`tests.netns.rank_host.partials`);
:meth:`Cluster.journal` reads the coordinator's journal file.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lossreduce.server.journal import JournalSettings, RoundJournal
from lossreduce.server.journal_store import decode_outcome
from lossreduce.server.outcomes import Outcome, RoundKey
from tests.netns.harness import Host, Network, NsProcess
from tests.netns.rank_host import TERMS, partials

COORDINATOR_PORT = 50051
AGENT_PORT = 50061
METRICS_PORT = 9464
SEED = 20261203
RANK_HOST = Path(__file__).with_name("rank_host.py")
SERVE_READY = "lossreduce coordinator serving on"
AGENT_READY = "lossreduce agent serving on"


def _flags(options: Mapping[str, object]) -> list[str]:
    """``{"round_timeout_s": 3}`` -> ``["--round-timeout-s", "3"]`` (the settings_cli rule)."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, tuple | list):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out


@dataclass
class Node:
    host: Host
    ranks: tuple[int, ...]
    ranks_process: NsProcess
    agent: NsProcess | None = None


@dataclass
class Cluster:
    """Coordinator and nodes; ``job`` names the training job of every rank."""

    network: Network
    coordinator_host: Host
    coordinator: NsProcess
    journal_path: Path
    nodes: list[Node] = field(default_factory=list)
    job: str = "netfault"
    world: int = 0

    @property
    def coordinator_target(self) -> str:
        return f"{self.coordinator_host.address}:{COORDINATOR_PORT}"

    def node_of(self, rank: int) -> Node:
        return next(node for node in self.nodes if rank in node.ranks)

    def ranks(self, nodes: Iterable[Node] | None = None) -> list[int]:
        return sorted(r for node in (self.nodes if nodes is None else nodes) for r in node.ranks)

    def send(self, step: int, ranks: Sequence[int]) -> None:
        """Start step ``step`` on ``ranks`` (each node's ranks process gets one command)."""
        for node in self.nodes:
            mine = [r for r in ranks if r in node.ranks]
            if mine:
                node.ranks_process.send(json.dumps({"step": step, "ranks": mine}))

    def collect(self, ranks: Sequence[int], timeout_s: float) -> dict[int, dict[str, Any]]:
        """One result line per rank in ``ranks`` (any step), waiting at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        results: dict[int, dict[str, Any]] = {}
        for node in self.nodes:
            want = [r for r in ranks if r in node.ranks]
            while len([r for r in want if r in results]) < len(want):
                line = json.loads(node.ranks_process.line(max(deadline - time.monotonic(), 0.01)))
                results[int(line["rank"])] = line
        return results

    def step(
        self, step: int, ranks: Sequence[int] | None = None, timeout_s: float = 60.0
    ) -> dict[int, dict[str, Any]]:
        chosen = self.ranks() if ranks is None else list(ranks)
        self.send(step, chosen)
        return self.collect(chosen, timeout_s)

    def expected(self, step: int) -> dict[str, str]:
        rows = [partials(SEED, rank, step) for rank in range(self.world)]
        return {term: math.fsum(row[term] for row in rows).hex() for term in TERMS}

    def journal(self) -> dict[int, Outcome]:
        """The coordinator's journal of this job: step -> outcome (one row per step)."""
        with RoundJournal(JournalSettings(path=self.journal_path)) as journal:
            records = journal.records(self.job)
        steps = [r.step for r in records]
        assert len(steps) == len(set(steps)), f"a step is journaled twice: {sorted(steps)}"
        return {
            r.step: decode_outcome(RoundKey(r.job, r.group, r.step), r.payload) for r in records
        }

    def metric(self, name: str, **labels: str) -> float:
        """Sum of one coordinator metric's samples whose labels include ``labels``
        (scraped from inside the coordinator's namespace)."""
        url = f"http://{self.coordinator_host.address}:{METRICS_PORT}/metrics"
        text = self.coordinator_host.python(
            f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
        )
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                head, _, value = line.rpartition(" ")
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total

    def restart_coordinator(self) -> None:
        self.coordinator.kill()
        self.coordinator.start(SERVE_READY)

    def restart_agent(self, node: Node) -> None:
        assert node.agent is not None
        node.agent.kill()
        node.agent.start(AGENT_READY)


def start_cluster(
    network: Network,
    workdir: Path,
    *,
    nodes: int,
    ranks_per_node: int,
    serve: Mapping[str, object],
    client: Mapping[str, object],
    agent: Mapping[str, object] | None,
) -> Cluster:
    """Start the coordinator, then each node's agent (when ``agent`` is given: its
    settings) and ranks process (``client``: the ranks' ClientSettings)."""
    coord_host = network.add_host("coord")
    journal = workdir / "journal.sqlite3"
    serve_command = [
        sys.executable,
        "-m",
        "lossreduce.cli",
        "serve",
        "--host",
        coord_host.address,
        "--port",
        str(COORDINATOR_PORT),
        "--metrics-port",
        str(METRICS_PORT),
        "--journal",
        str(journal),
        "--insecure",
        *_flags(serve),
    ]
    coordinator = coord_host.spawn("serve", serve_command, ready=SERVE_READY)
    cluster = Cluster(network, coord_host, coordinator, journal, world=nodes * ranks_per_node)
    for i in range(nodes):
        host = network.add_host(f"n{i}")
        ranks = tuple(range(i * ranks_per_node, (i + 1) * ranks_per_node))
        agent_process = None
        target = cluster.coordinator_target
        if agent is not None:
            agent_command = [
                sys.executable,
                "-m",
                "lossreduce.cli",
                "agent",
                "--upstream",
                cluster.coordinator_target,
                "--job",
                cluster.job,
                "--world-size",
                str(cluster.world),
                "--host",
                "127.0.0.1",
                "--port",
                str(AGENT_PORT),
                "--local-ranks",
                ",".join(map(str, ranks)),
                *_flags(agent),
            ]
            agent_process = host.spawn("agent", agent_command, ready=AGENT_READY)
            target = f"127.0.0.1:{AGENT_PORT}"
        ranks_command = [
            sys.executable,
            str(RANK_HOST),
            "--target",
            target,
            "--job",
            cluster.job,
            "--ranks",
            ",".join(map(str, ranks)),
            "--world",
            str(cluster.world),
            "--seed",
            str(SEED),
            "--settings",
            json.dumps(dict(client)),
        ]
        process = host.spawn("ranks", ranks_command, pipe=True)
        line = json.loads(process.line(60.0))
        assert line == {"ready": list(ranks)}, line
        cluster.nodes.append(Node(host, ranks, process, agent_process))
    return cluster
