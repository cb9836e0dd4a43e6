"""Body of the multi-process M2PO tests: one spawned process per rank, gloo on CPU.

Every rank computes the global cut-off of its own ``m2`` values through
torch.distributed and through a real coordinator, in several scenarios in a
row (the same on every rank, as a real job), and saves what it got for the
parent test to compare with the single-process reference.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from lossreduce.errors import LossReduceError
from lossreduce.trainer_worker import CoordinatorNormalizer, TorchDistributedNormalizer
from lossreduce.trainer_worker.m2po import global_m2po_cutoff
from lossreduce.trainer_worker.normalizers.base import GlobalNormalizer
from tests.trainer_worker.dist_harness import run_rank

THRESHOLD = 0.04
EMPTY_RANK = 2
"""This rank has no active token (its loss mask is all False)."""


def rank_batch(rank: int, rows: int = 6, width: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """(m2 [rows, width], loss mask [rows, width]) of one rank: log-normal values over many
    binades, zeros, and a tie group near the cut."""
    gen = torch.Generator().manual_seed(100 + rank)
    m2 = torch.exp(torch.randn(rows, width, generator=gen, dtype=torch.float64) * 3) * 0.01
    m2[0, :10] = 0.0
    m2[1, :8] = 0.25
    mask = torch.rand(rows, width, generator=gen) < 0.8
    if rank == EMPTY_RANK:
        mask[:] = False
    return m2, mask


def union_of(world: int) -> torch.Tensor:
    """Every rank's active values, as the single-process reference sees the mini-batch."""
    return torch.cat([m2[mask] for m2, mask in map(rank_batch, range(world))])


def capture(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        out = run()
    except LossReduceError as err:
        out = {
            "error": type(err).__name__,
            "message": str(err),
            "ranks": err.ranks,
            "rank": err.rank,
        }
    return {**out, "seconds": time.perf_counter() - started}


def cut_of(
    normalizer: GlobalNormalizer,
    step: int,
    m2: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    rank: int,
    world: int,
    threshold: float = THRESHOLD,
) -> dict[str, Any]:
    cut = global_m2po_cutoff(
        m2, threshold, normalizer, step, rank=rank, world_size=world, mask=mask, job="m2", group="g"
    )
    return {
        "cutoff": cut.cutoff,
        "kept": cut.kept,
        "total": cut.total,
        "rounds": cut.rounds,
        "wire_bytes": cut.wire_bytes,
        "keep": cut.keep(m2, mask),
    }


def backend_scenarios(
    normalizer: GlobalNormalizer, rank: int, world: int, first_step: int
) -> dict[str, dict[str, Any]]:
    m2, mask = rank_batch(rank)
    poisoned = m2.clone()
    if rank == 1:
        poisoned[1, 2] = math.nan
        mask[1, 2] = True
    return {
        "batch": capture(lambda: cut_of(normalizer, first_step, m2, mask, rank=rank, world=world)),
        "all_masked": capture(
            lambda: cut_of(
                normalizer, first_step + 1, m2[mask] + 0.05, None, rank=rank, world=world
            )
        ),
        "nan": capture(
            lambda: cut_of(normalizer, first_step + 2, poisoned, mask, rank=rank, world=world)
        ),
        "after_nan": capture(
            lambda: cut_of(normalizer, first_step + 3, m2, mask, rank=rank, world=world)
        ),
        "mismatch": capture(
            lambda: cut_of(
                normalizer,
                first_step + 4,
                m2,
                mask,
                rank=rank,
                world=world,
                threshold=0.05 if rank == 0 else THRESHOLD,
            )
        ),
    }


def worker(rank: int, world: int, port: int, out_dir: str, target: str) -> None:
    """torch.multiprocessing.spawn entry point."""

    def body() -> dict[str, Any]:
        from lossreduce.client import ReductionClient

        out = {
            f"torch_{k}": v
            for k, v in backend_scenarios(
                TorchDistributedNormalizer(job="m2", group="g.m2po"), rank, world, 0
            ).items()
        }
        with ReductionClient(
            target, job="m2", group="g.m2po", rank=rank, world_size=world
        ) as client:
            coord = CoordinatorNormalizer(client)
            out.update(
                {f"coord_{k}": v for k, v in backend_scenarios(coord, rank, world, 10).items()}
            )
        return out

    run_rank(rank, world, port, out_dir, body)
