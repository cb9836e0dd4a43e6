"""The measurement loop of ``lossreduce bench``: one world size at a time.

Every contender runs on the same load processes, interleaved round by round
(and the order rotated every round), so a drift in the machine's speed hits
every contender alike and the ratios hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lossreduce.bench.contenders import Endpoints
from lossreduce.bench.hosts import HIERARCHICAL, HostPlan, HostPool, split_ranks
from lossreduce.bench.report import Skipped
from lossreduce.bench.stats import ContenderResult, round_latency_ns, summarize

__all__ = ["OWN_PROCESSES", "CpuReader", "Placement", "WorldRun", "place", "run_world", "settle"]

CpuReader = Callable[[], int]

OWN_PROCESSES = ("gloo", "ray-actor")
"""Contenders whose ranks get load processes of their own. Ray's core worker
and gloo's transport keep threads running in every process that joins them;
in a shared load process that background CPU would be charged to every other
contender's client CPU, most to the one with the longest rounds."""


@dataclass(frozen=True)
class Placement:
    """How the ranks of one world size are spread over load processes."""

    processes: int
    simulated: bool
    ranks_by_contender: dict[str, list[tuple[int, ...]]]
    """Contender -> ranks per load process (index = load process)."""
    skipped: list[Skipped]


def place(
    world_size: int,
    contenders: Sequence[str],
    *,
    max_processes: int,
    gloo_max_processes: int,
    load_processes: int,
    ray_processes: int,
    ranks_per_node: int,
) -> Placement:
    """Where the ranks of one world size run.

    One process per rank up to ``max_processes``; beyond, the ranks are
    simulated as asyncio tasks over ``load_processes`` processes. gloo cannot
    be simulated (one process group per process), so it runs one process per
    rank up to ``gloo_max_processes`` (what the file and memory limits allow)
    and is skipped beyond. The Ray contender's ranks share at most
    ``ray_processes`` processes, each a Ray driver. The hierarchical
    contender's nodes (``ranks_per_node`` consecutive ranks and their
    aggregator) are never split across processes. Every contender but those in
    :data:`OWN_PROCESSES` shares the same load processes.
    """
    simulated = world_size > max_processes
    rank_processes = min(load_processes if simulated else world_size, world_size)
    gloo_fits = world_size <= gloo_max_processes
    blocks = split_ranks(world_size, rank_processes)
    by: dict[str, list[tuple[int, ...]]] = {}
    skipped: list[Skipped] = []
    for name in contenders:
        if name == "gloo":
            if not gloo_fits:
                skipped.append(
                    Skipped(
                        name,
                        world_size,
                        f"gloo needs one process per rank and N={world_size} exceeds the "
                        f"{gloo_max_processes} processes the file and memory limits allow "
                        "(--gloo-max-processes)",
                    )
                )
                continue
            by[name] = split_ranks(world_size, world_size)
        elif name in HIERARCHICAL:
            if world_size % ranks_per_node:
                skipped.append(
                    Skipped(
                        name,
                        world_size,
                        f"N={world_size} is not a whole number of nodes of {ranks_per_node} "
                        "ranks (--ranks-per-node)",
                    )
                )
                continue
            node_blocks = split_ranks(world_size // ranks_per_node, load_processes)
            by[name] = [
                tuple(range(b[0] * ranks_per_node, (b[-1] + 1) * ranks_per_node))
                for b in node_blocks
            ]
        elif name == "ray-actor":
            by[name] = split_ranks(world_size, min(ray_processes, rank_processes))
        else:
            by[name] = blocks
    # Shared load processes first, then those of the contenders kept apart.
    processes = max((len(by[n]) for n in by if n not in OWN_PROCESSES), default=0)
    for name in OWN_PROCESSES:
        if name in by:
            by[name] = [() for _ in range(processes)] + by[name]
            processes = len(by[name])
    by = {name: _padded(blocks_of, processes) for name, blocks_of in by.items()}
    return Placement(processes, simulated, by, skipped)


def _padded(blocks: list[tuple[int, ...]], processes: int) -> list[tuple[int, ...]]:
    return blocks + [() for _ in range(processes - len(blocks))]


@dataclass
class WorldRun:
    """Inputs of one world size's measurement."""

    world_size: int
    placement: Placement
    endpoints: Endpoints
    rounds: int
    warmup_rounds: int
    server_cpu: dict[str, CpuReader]
    """Contender -> reader of its server process's CPU ns (where it has one)."""
    startup_timeout_s: float


def run_world(run: WorldRun) -> list[ContenderResult]:
    """Start the load processes, run every contender's rounds interleaved, stop."""
    contenders = list(run.placement.ranks_by_contender)
    if not contenders:
        return []  # every contender was skipped at this N
    plans = [
        HostPlan(
            index=i,
            world_size=run.world_size,
            endpoints=run.endpoints,
            ranks={name: blocks[i] for name, blocks in run.placement.ranks_by_contender.items()},
        )
        for i in range(run.placement.processes)
    ]
    pool = HostPool(plans)
    latencies: dict[str, list[int]] = {name: [] for name in contenders}
    cpu: dict[str, int] = dict.fromkeys(run.server_cpu, 0)
    client_cpu: dict[str, int] = dict.fromkeys(contenders, 0)
    try:
        pool.wait_ready(run.startup_timeout_s)
        for index in range(run.warmup_rounds + run.rounds):
            step = index + 1
            shift = index % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                reader = run.server_cpu.get(name)
                before = reader() if reader else 0
                stamps = pool.run_round(name, step)
                after = reader() if reader else 0
                if index >= run.warmup_rounds:
                    latencies[name].append(round_latency_ns([(a, b) for a, b, _ in stamps]))
                    client_cpu[name] += sum(c for _, _, c in stamps)
                    if reader:
                        cpu[name] += after - before
    finally:
        pool.close()
    results = []
    for name in contenders:
        processes = len(pool.hosts_of(name))
        results.append(
            summarize(
                name,
                run.world_size,
                latencies[name],
                server_cpu_ns=cpu.get(name),
                client_cpu_ns=client_cpu[name],
                contributions_per_round=run.world_size,
                rank_processes=processes,
                simulated=processes < run.world_size,
            )
        )
    return results


def settle(seconds: float) -> None:
    """Let the machine quiet down between world sizes (process exits, GC)."""
    time.sleep(seconds)
