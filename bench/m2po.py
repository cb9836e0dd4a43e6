"""``lossreduce bench --m2po``: the global M2PO cut-off at scale, against an all-gather.

``world_size`` gloo ranks (spawned processes on this host) each hold
``tokens_per_rank`` float64 ``m2`` values (log-normal over many binades, a block
of zeros, a tie group). Each repeat times, on every rank and in one run:

- the search through torch.distributed (:class:`TorchDistributedNormalizer`);
- the search through a real coordinator (a :class:`CoordinatorThread` here,
  :class:`CoordinatorNormalizer` over gRPC on loopback);
- the naive exact method: a gloo ``all_gather`` of every value, then sorting the
  union (the least any exact method that gathers the values pays).

Bytes are counted per rank and round: the coordinator's as the serialized
``ReduceRequest`` / ``ReduceResponse`` messages (protobuf, without HTTP/2
framing), torch.distributed's as the float64 payload of its two all_gathers
(header and partials). Rank 0 also checks, once, that every method's kept count
is the exact single-process reference's over the gathered union.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["M2POBenchSettings", "format_m2po_bench", "run_m2po_bench"]


class M2POBenchSettings(BaseModel):
    """What ``lossreduce bench --m2po`` measures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: int = Field(default=8, ge=1, description="Ranks (spawned gloo processes).")
    tokens_per_rank: int = Field(
        default=1_000_000, ge=0, description="Active tokens (m2 values) per rank."
    )
    threshold: float = Field(default=0.04, gt=0, description="The M2PO threshold.")
    repeats: int = Field(default=3, ge=1, description="Timed repeats of each method.")
    max_terms: int = Field(
        default=64, ge=8, description="Terms per round (the coordinator's max_terms)."
    )
    round_timeout_s: float = Field(
        default=600.0, gt=0, description="The coordinator's round timeout (ranks on a busy host)."
    )


def rank_values(rank: int, tokens: int) -> Any:
    """Rank ``rank``'s ``[tokens]`` float64 m2 values (deterministic)."""
    import torch

    gen = torch.Generator().manual_seed(7919 + rank)
    m2 = torch.exp(torch.randn(tokens, generator=gen, dtype=torch.float64) * 3) * 0.01
    m2[: tokens // 20] = 0.0  # tokens whose policy did not move
    m2[tokens // 20 : tokens // 20 + tokens // 100] = 0.04  # a tie group at the threshold
    return m2


class _Recording:
    """A normalizer that records each round's partials and contracts, then delegates."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rounds: list[tuple[int, dict[str, float], dict[str, str]]] = []

    def start(self, step: int, partials: Mapping[str, Any], contracts: Any = None) -> Any:
        return self.inner.start(step, partials, contracts)

    def reduce(self, step: int, partials: Mapping[str, Any], contracts: Any = None) -> Any:
        self.rounds.append(
            (step, {t: float(v) for t, v in partials.items()}, dict(contracts or {}))
        )
        return self.inner.reduce(step, partials, contracts)


def _coordinator_bytes(
    rounds: list[tuple[int, dict[str, float], dict[str, str]]],
    job: str,
    group: str,
    rank: int,
    world: int,
) -> tuple[int, int]:
    """(request bytes sent, response bytes received) of these rounds, serialized."""
    from lossreduce.v2 import coordinator_pb2 as pb

    sent = received = 0
    for step, partials, contracts in rounds:
        request = pb.ReduceRequest(rank=rank, world_size=world)
        request.round.job, request.round.group, request.round.step = job, group, step
        for term, value in partials.items():
            request.partials.add(term=term, value=value, contract=contracts.get(term, ""))
        response = pb.ReduceResponse()
        response.round.job, response.round.group, response.round.step = job, group, step
        for term, value in partials.items():
            response.normalizers.add(term=term, value=value * world)
        sent += request.ByteSize()
        received += response.ByteSize()
    return sent, received


def _rank_main(rank: int, port: int, out_dir: str, target: str, settings_json: str) -> None:
    """One rank's process: its measurements, saved to ``out_dir``."""
    import torch
    import torch.distributed as dist

    from lossreduce.client import ReductionClient
    from lossreduce.trainer_worker import CoordinatorNormalizer, TorchDistributedNormalizer
    from lossreduce.trainer_worker.m2po import global_m2po_cutoff, m2po_cutoff_reference

    settings = M2POBenchSettings.model_validate_json(settings_json)
    world = settings.world_size
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=settings.round_timeout_s),
    )
    m2 = rank_values(rank, settings.tokens_per_rank)
    started = time.perf_counter()
    torch.sort(m2)
    out_sort = time.perf_counter() - started  # the search's own first step, for scale
    job, group = "bench-m2po", "g.m2po"
    out: dict[str, Any] = {"torch": [], "coord": [], "gather": [], "sort_seconds": out_sort}
    with ReductionClient(target, job=job, group=group, rank=rank, world_size=world) as client:
        torch_backend = TorchDistributedNormalizer(job=job, group=group)
        for repeat in range(settings.repeats):
            for name, inner in (("torch", torch_backend), ("coord", CoordinatorNormalizer(client))):
                recording = _Recording(inner)
                dist.barrier()
                cut = global_m2po_cutoff(
                    m2,
                    settings.threshold,
                    recording,
                    repeat,
                    rank=rank,
                    world_size=world,
                    max_terms=settings.max_terms,
                )
                if name == "coord":
                    sent, received = _coordinator_bytes(recording.rounds, job, group, rank, world)
                else:  # two all_gathers a round: a 3-float header, then the partials
                    sent = sum(8 * (3 + len(p)) for _, p, _ in recording.rounds)
                    received = world * sent
                out[name].append(
                    {
                        "seconds": cut.seconds,
                        "rounds": cut.rounds,
                        "terms": cut.terms_sent,
                        "sent_bytes": sent,
                        "received_bytes": received,
                        "kept": cut.kept,
                        "total": cut.total,
                        "cutoff": cut.cutoff,
                    }
                )
            dist.barrier()
            started = time.perf_counter()
            rows = [torch.empty_like(m2) for _ in range(world)]
            dist.all_gather(rows, m2)
            gathered = time.perf_counter()
            union = torch.sort(torch.cat(rows)).values
            done = time.perf_counter()
            out["gather"].append(
                {
                    "seconds": done - started,
                    "gather_seconds": gathered - started,
                    "sent_bytes": 8 * m2.numel(),
                    "received_bytes": 8 * (union.numel() - m2.numel()),
                }
            )
            if rank == 0 and repeat == 0:
                out["reference_kept"] = m2po_cutoff_reference(union, settings.threshold)[1]
            del rows, union
    dist.barrier()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # see tests/trainer_worker/dist_harness.py: no gloo teardown


def run_m2po_bench(settings: M2POBenchSettings) -> dict[str, Any]:
    """Run every rank, collect their measurements: medians over repeats, max over ranks."""
    import torch

    from lossreduce.ports import free_port
    from lossreduce.server import CoordinatorSettings, CoordinatorThread

    coordinator = CoordinatorSettings.model_validate(
        {
            "host": "127.0.0.1",
            "port": 0,
            "metrics_port": None,
            "round_timeout_s": settings.round_timeout_s,
            "max_terms": settings.max_terms,
        }
    )
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out, CoordinatorThread(coordinator) as coord:
        args = (free_port(), out, coord.target, settings.model_dump_json())
        processes = [
            context.Process(target=_rank_main, args=(rank, *args))
            for rank in range(settings.world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        failed = {r: p.exitcode for r, p in enumerate(processes) if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"M2PO bench ranks failed (rank: exit code): {failed}")
        ranks = [
            torch.load(Path(out) / f"rank{r}.pt", weights_only=False)
            for r in range(settings.world_size)
        ]
    report: dict[str, Any] = {"settings": settings.model_dump()}
    for method in ("torch", "coord", "gather"):
        runs = [r[method] for r in ranks]
        keys = [k for k, v in runs[0][0].items() if isinstance(v, (int, float))]
        report[method] = {
            k: max(statistics.median(float(run[k]) for run in rank_runs) for rank_runs in runs)
            for k in keys
        }
    kept = {run["kept"] for rank in ranks for m in ("torch", "coord") for run in rank[m]}
    report["kept"] = sorted(kept)
    report["local_sort_seconds"] = max(r["sort_seconds"] for r in ranks)
    report["reference_kept"] = ranks[0]["reference_kept"]
    report["exact"] = kept == {ranks[0]["reference_kept"]}
    return report


def format_m2po_bench(report: Mapping[str, Any]) -> str:
    """The report as a table: one row per method."""
    s = report["settings"]
    lines = [
        f"M2PO cut-off: {s['world_size']} ranks x {s['tokens_per_rank']} tokens, threshold "
        f"{s['threshold']}, max_terms {s['max_terms']} (median of {s['repeats']}, worst rank)",
        f"{'method':<28}{'rounds':>7}{'seconds':>9}{'sent B/rank':>13}{'recv B/rank':>13}",
    ]
    names = {
        "torch": "search, torch.distributed",
        "coord": "search, coordinator",
        "gather": "all_gather + sort",
    }
    for method, name in names.items():
        row = report[method]
        rounds = f"{row['rounds']:.0f}" if "rounds" in row else "1"
        lines.append(
            f"{name:<28}{rounds:>7}{row['seconds']:>9.3f}"
            f"{row['sent_bytes']:>13.0f}{row['received_bytes']:>13.0f}"
        )
    lines.append(
        f"all_gather alone {report['gather']['gather_seconds']:.3f} s; sorting one rank's "
        f"{s['tokens_per_rank']} values {report['local_sort_seconds']:.3f} s"
    )
    lines.append(
        f"kept {report['kept']} of {s['world_size'] * s['tokens_per_rank']}; the exact "
        f"reference keeps {report['reference_kept']}: "
        + ("equal" if report["exact"] else "DIFFERENT")
    )
    return "\n".join(lines)
