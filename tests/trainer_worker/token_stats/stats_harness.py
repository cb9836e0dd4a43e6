"""Body of the multi-process token statistics tests: one spawned process per rank, gloo on CPU.

Every rank computes global sums and k-th keys of its own tokens through
torch.distributed and through a real coordinator, in several scenarios in a
row (the same on every rank, as a real job), and saves what it got for the
parent test to compare with the in-process simulation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lossreduce.errors import LossReduceError
from lossreduce.trainer_worker import CoordinatorNormalizer, TorchDistributedNormalizer
from lossreduce.trainer_worker.normalizers.base import GlobalNormalizer
from lossreduce.trainer_worker.token_stats import (
    draw_keys,
    float_order_keys,
    global_exact_sums,
    global_kth_smallest,
    seed_of,
)
from tests.trainer_worker.dist_harness import run_rank

EMPTY_RANK = 1
"""This rank holds no token in the scenarios named ``*_empty``."""
TOP_K = 37
DRAW_K = 50


def rank_tokens(rank: int, rows: int = 8, width: int = 40) -> dict[str, torch.Tensor]:
    """One rank's tokens: float32 advantages and log-probs, and each token's row and position."""
    gen = torch.Generator().manual_seed(200 + rank)
    mask = torch.rand(rows, width, generator=gen) < 0.7  # [rows, width]
    adv = torch.randn(rows, 1, generator=gen).expand(rows, width)[mask]  # one per row
    logp = (-torch.rand(rows, width, generator=gen) * 8)[mask]
    row_ids = (torch.arange(rows)[:, None] + rows * rank).expand(rows, width)[mask]
    positions = torch.arange(width)[None, :].expand(rows, width)[mask]
    return {"adv": adv, "logp": logp, "rows": row_ids, "positions": positions}


def capture(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return run()
    except LossReduceError as err:
        return {
            "error": type(err).__name__,
            "message": str(err),
            "ranks": err.ranks,
            "rank": err.rank,
            "terms": err.terms,
        }


def scenarios(
    normalizer: GlobalNormalizer, rank: int, world: int, first_step: int
) -> dict[str, dict[str, Any]]:
    tokens = rank_tokens(rank)
    values = {"adv": tokens["adv"], "logp": tokens["logp"]}
    empty = {name: v[:0] for name, v in values.items()} if rank == EMPTY_RANK else values
    poisoned = dict(values)
    if rank == 1:
        poisoned["logp"] = values["logp"].clone()
        poisoned["logp"][3] = -math.inf

    def sums(step: int, given: dict[str, torch.Tensor], max_terms: int = 64) -> dict[str, Any]:
        got = global_exact_sums(
            given,
            normalizer,
            step,
            rank=rank,
            world_size=world,
            job="s",
            group="g",
            max_terms=max_terms,
        )
        return {"sums": got}

    def kth(step: int, keys: torch.Tensor, k: int, max_terms: int = 64) -> dict[str, Any]:
        got = global_kth_smallest(
            keys, k, normalizer, step, rank=rank, world_size=world, max_terms=max_terms
        )
        return {"kth": got, "selected": got.select(keys)}

    def top_k(step: int) -> dict[str, Any]:
        # clip_cov's shape: the global means, then the k largest covariances.
        means = global_exact_sums(values, normalizer, step, rank=rank, world_size=world)
        adv_mean, logp_mean = means["adv"].mean, means["logp"].mean
        assert adv_mean is not None
        assert logp_mean is not None
        cov = (values["adv"].double() - adv_mean) * (values["logp"].double() - logp_mean)
        return kth(step + 1, float_order_keys(-cov), TOP_K)

    draw = draw_keys(seed_of("s", "g", 0, "draw"), tokens["rows"], tokens["positions"])
    s = first_step
    return {
        "sums": capture(lambda: sums(s, values)),
        "sums_empty": capture(lambda: sums(s + 1, empty)),
        "sums_few_terms": capture(lambda: sums(s + 2, values, max_terms=5)),
        "sums_inf": capture(lambda: sums(s + 3, poisoned)),
        "sums_after_inf": capture(lambda: sums(s + 4, values)),
        "sums_mismatch": capture(
            lambda: sums(s + 5, values if rank == 0 else {"adv": values["adv"]})
        ),
        "top_k": capture(lambda: top_k(s + 6)),
        "draw": capture(lambda: kth(s + 8, draw, DRAW_K)),
        "draw_few_terms": capture(lambda: kth(s + 9, draw, DRAW_K, max_terms=3)),
        "kth_empty": capture(lambda: kth(s + 10, draw[:0] if rank == EMPTY_RANK else draw, 10**6)),
        "kth_mismatch": capture(lambda: kth(s + 11, draw, DRAW_K + rank)),
    }


def worker(rank: int, world: int, port: int, out_dir: str, target: str) -> None:
    """torch.multiprocessing.spawn entry point."""

    def body() -> dict[str, Any]:
        from lossreduce.client import ReductionClient

        torch_backend = TorchDistributedNormalizer(job="s", group="g.stats")
        out = {f"torch_{k}": v for k, v in scenarios(torch_backend, rank, world, 0).items()}
        with ReductionClient(
            target, job="s", group="g.stats", rank=rank, world_size=world
        ) as client:
            coord = CoordinatorNormalizer(client)
            out.update({f"coord_{k}": v for k, v in scenarios(coord, rank, world, 20).items()})
        return out

    run_rank(rank, world, port, out_dir, body)
