"""Pure statistics of ``lossreduce bench``: round latencies in, summaries and ratios out.

No processes, sockets or clocks here, so the arithmetic is unit-testable alone.
A round's latency is measured across processes as ``max(end) - min(start)``
over every load process taking part: from the first rank issuing its
contribution to the last rank holding the sums. The start and end stamps come
from ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux, shared by every
process of the machine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ContenderResult",
    "percentile",
    "ratio",
    "round_latency_ns",
    "summarize",
]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, by linear
    interpolation between closest ranks (numpy's default method)."""
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q!r} must lie in [0, 100]")
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = math.ceil(position)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def round_latency_ns(stamps: Sequence[tuple[int, int]]) -> int:
    """One round's latency from every load process's ``(start_ns, end_ns)``."""
    if not stamps:
        raise ValueError("a round needs at least one load process's stamps")
    return max(end for _, end in stamps) - min(start for start, _ in stamps)


@dataclass(frozen=True)
class ContenderResult:
    """What the benchmark reports for one contender at one world size."""

    contender: str
    world_size: int
    rounds: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    rounds_per_s: float
    server_cpu_us_per_contribution: float | None
    """Server process CPU time over the measured rounds / (rounds x contributions);
    None where the contender has no separately measurable server."""
    client_cpu_us_per_rank: float | None
    """CPU time of the load processes over the measured rounds / (rounds x ranks): what
    one rank's side of one round costs (every thread of the rank processes, the
    shipped client's own included)."""
    rank_processes: int
    """How many load processes hosted the ranks."""
    simulated: bool
    """True when ranks ran as asyncio tasks sharing load processes rather than one
    process per rank."""
    note: str = ""


def summarize(
    contender: str,
    world_size: int,
    latencies_ns: Sequence[int],
    *,
    server_cpu_ns: int | None,
    contributions_per_round: int,
    client_cpu_ns: int | None = None,
    rank_processes: int,
    simulated: bool,
    note: str = "",
) -> ContenderResult:
    """Summarize one contender's measured rounds at one world size."""
    if not latencies_ns:
        raise ValueError(f"contender {contender!r} at N={world_size} measured no rounds")
    ordered = sorted(latencies_ns)
    mean_ns = math.fsum(ordered) / len(ordered)
    cpu_us: float | None = None
    if server_cpu_ns is not None:
        cpu_us = server_cpu_ns / 1e3 / (len(ordered) * contributions_per_round)
    client_us: float | None = None
    if client_cpu_ns is not None:
        client_us = client_cpu_ns / 1e3 / (len(ordered) * world_size)
    return ContenderResult(
        contender=contender,
        world_size=world_size,
        rounds=len(ordered),
        p50_ms=percentile(ordered, 50) / 1e6,
        p99_ms=percentile(ordered, 99) / 1e6,
        mean_ms=mean_ns / 1e6,
        rounds_per_s=1e9 / mean_ns if mean_ns > 0 else math.inf,
        server_cpu_us_per_contribution=cpu_us,
        client_cpu_us_per_rank=client_us,
        rank_processes=rank_processes,
        simulated=simulated,
        note=note,
    )


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or None when the denominator is not positive."""
    if denominator <= 0 or not math.isfinite(denominator):
        return None
    return numerator / denominator
