"""What ``lossreduce bench`` writes: the ratios, the targets, a table, JSON and a plot.

The ratios and target checks are pure functions of the results; only
:func:`write_plot` touches matplotlib (Agg backend, no display needed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from lossreduce.bench.stats import ContenderResult, ratio

__all__ = [
    "REFERENCE",
    "Skipped",
    "Target",
    "format_table",
    "ratios",
    "targets",
    "write_json",
    "write_plot",
]

REFERENCE = "coordinator-stream"
"""The contender every ratio is taken against (the coordinator's default path)."""


@dataclass(frozen=True)
class Skipped:
    """A contender not run at a world size, and why."""

    contender: str
    world_size: int
    reason: str


@dataclass(frozen=True)
class Target:
    """One of the Performance targets (``docs/performance.md``), as measured in this run."""

    name: str
    measured: float | None
    limit: float
    met: bool | None
    """None when the run did not measure what the target needs."""
    detail: str


def _index(results: Sequence[ContenderResult]) -> dict[tuple[str, int], ContenderResult]:
    return {(r.contender, r.world_size): r for r in results}


def ratios(results: Sequence[ContenderResult]) -> list[dict[str, object]]:
    """p50 of the coordinator stream over each other contender's, per world size
    (below 1: the coordinator is faster)."""
    by_key = _index(results)
    rows: list[dict[str, object]] = []
    for r in results:
        ref = by_key.get((REFERENCE, r.world_size))
        if r.contender == REFERENCE or ref is None:
            continue
        rows.append(
            {
                "world_size": r.world_size,
                "contender": r.contender,
                "p50_ratio": ratio(ref.p50_ms, r.p50_ms),
                "p99_ratio": ratio(ref.p99_ms, r.p99_ms),
            }
        )
    return rows


def _relative(
    name: str,
    *,
    by_key: Mapping[tuple[str, int], ContenderResult],
    world_sizes: Sequence[int],
    other: str,
    limit: float,
    subject: str = REFERENCE,
    metric: str = "p50_ms",
) -> Target:
    """The worst ``subject / other`` ratio of ``metric`` over ``world_sizes``, against ``limit``."""
    worst: float | None = None
    details: list[str] = []
    for n in world_sizes:
        ref, against = by_key.get((subject, n)), by_key.get((other, n))
        if ref is None or against is None:
            continue
        mine, theirs = getattr(ref, metric), getattr(against, metric)
        if mine is None or theirs is None:
            continue
        value = ratio(mine, theirs)
        if value is None:
            continue
        details.append(f"N={n}: {mine:.3f} / {theirs:.3f} = {value:.2f}x")
        worst = value if worst is None else max(worst, value)
    met = None if worst is None else worst <= limit
    return Target(name, worst, limit, met, "; ".join(details) or "not measured")


def _absolute(name: str, measured: float | None, limit: float, unit: str) -> Target:
    met = None if measured is None else measured <= limit
    detail = "not measured" if measured is None else f"{measured:.4g} {unit}".rstrip()
    return Target(name, measured, limit, met, detail)


def targets(
    results: Sequence[ContenderResult],
    *,
    hierarchical_world_size: int | None = None,
    e2e_ratio: float | None = None,
) -> list[Target]:
    """Check the Performance targets (``docs/performance.md``) against one run's results.

    The coordinator is measured against the ``bare-echo`` reference (grpc.aio's
    own floor on this machine, driven by the same load) and against the peers.
    """
    by_key = _index(results)
    sizes = sorted({r.world_size for r in results})
    scale = [hierarchical_world_size] if hierarchical_world_size else []
    return [
        _relative(
            "N=1,8: client CPU per round per rank, coordinator-stream (shipped client) "
            "<= 1.2x bare-stream",
            by_key=by_key,
            world_sizes=[n for n in (1, 8) if n in sizes],
            other="bare-stream",
            limit=1.2,
            metric="client_cpu_us_per_rank",
        ),
        _relative(
            "N=8: coordinator-stream (shipped client) p50 <= 1.15x bare-stream p50",
            by_key=by_key,
            world_sizes=[n for n in (8,) if n in sizes],
            other="bare-stream",
            limit=1.15,
        ),
        _relative(
            "N=256: coordinator server CPU per contribution <= 1.15x bare-echo's per message",
            by_key=by_key,
            world_sizes=[256],
            other="bare-echo",
            limit=1.15,
            metric="server_cpu_us_per_contribution",
        ),
        _relative(
            "N=8,64,256: coordinator-stream (shipped client) p50 <= 1.25x bare-echo p50",
            by_key=by_key,
            world_sizes=[n for n in (8, 64, 256) if n in sizes],
            other="bare-echo",
            limit=1.25,
        ),
        _relative(
            "ranks behind node agents at scale (README: 4096): p50 <= 1.25x the same "
            "topology against the echo",
            by_key=by_key,
            world_sizes=scale,
            other="hierarchical-echo",
            limit=1.25,
            subject="coordinator-hierarchical",
        ),
        _relative(
            "N>=4: coordinator-stream p50 < gloo p50",
            by_key=by_key,
            world_sizes=[n for n in sizes if n >= 4],
            other="gloo",
            limit=1.0,
        ),
        _relative(
            "N>=64: coordinator-stream >= 3x faster than the Ray actor",
            by_key=by_key,
            world_sizes=[n for n in sizes if n >= 64],
            other="ray-actor",
            limit=1 / 3,
        ),
        _relative(
            "N>=64: coordinator-stream p50 <= TCPStore p50",
            by_key=by_key,
            world_sizes=[n for n in sizes if n >= 64],
            other="tcpstore",
            limit=1.0,
        ),
        _absolute("train step, coordinator / torch normalizer <= 1.02", e2e_ratio, 1.02, ""),
    ]


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(results: Sequence[ContenderResult], skipped: Sequence[Skipped]) -> str:
    """A Markdown table of every result, then the skipped contenders."""
    by_key = _index(results)
    lines = [
        "| N | contender | p50 ms | p99 ms | rounds/s | server CPU us/contrib | client CPU us/rank | stream/contender p50 | load processes |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: (r.world_size, r.contender)):
        ref = by_key.get((REFERENCE, r.world_size))
        rel = ratio(ref.p50_ms, r.p50_ms) if ref is not None else None
        procs = f"{r.rank_processes}" + (" (simulated ranks)" if r.simulated else "")
        lines.append(
            f"| {r.world_size} | {r.contender} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | "
            f"{r.rounds_per_s:.0f} | {_cell(r.server_cpu_us_per_contribution, '.1f')} | "
            f"{_cell(r.client_cpu_us_per_rank, '.0f')} | {_cell(rel, '.2f')} | {procs} |"
        )
    for s in skipped:
        lines.append(f"| {s.world_size} | {s.contender} | skipped: {s.reason} | | | | | | |")
    return "\n".join(lines)


def write_json(path: Path, payload: Mapping[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to the benchmark JSON")


def write_plot(path: Path, results: Sequence[ContenderResult], title: str) -> None:
    """Round latency p50 (solid) and p99 (dotted) against N, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for contender in sorted({r.contender for r in results}):
        rows = sorted((r for r in results if r.contender == contender), key=lambda r: r.world_size)
        xs = [r.world_size for r in rows]
        (line,) = ax.plot(xs, [r.p50_ms for r in rows], marker="o", label=f"{contender} p50")
        ax.plot(xs, [r.p99_ms for r in rows], linestyle=":", color=line.get_color(), alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("round latency, ms (solid p50, dotted p99)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
