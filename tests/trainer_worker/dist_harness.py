"""Body of the multi-process tests: one spawned process per rank, gloo on CPU.

Each rank trains the toy problem on its shard of the prompt groups through
several scenarios in a row (all ranks run the same sequence, as a real job
would), records gradients, stats and errors, and saves them for the parent
test to compare with a single-process :class:`LocalNormalizer` run.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lossreduce.errors import LossReduceError
from lossreduce.trainer_worker import (
    CoordinatorNormalizer,
    GlobalNormalizer,
    LossReduction,
    LossTerm,
    MicrobatchSettings,
    MicrobatchSplitter,
    OnEmptyStep,
    TorchDistributedNormalizer,
    TorchTrainEngine,
)
from tests.trainer_worker.toy import (
    THREE_TERMS,
    Group,
    TermSpec,
    build_batch,
    forward,
    grads_of,
    make_groups,
    make_model,
    make_reduction,
)

GROUP_SIZES = [3, 1, 4, 2, 2, 3, 1, 2]
SEED = 5
LR = 0.05


def all_groups() -> list[Group]:
    return make_groups(SEED, GROUP_SIZES, p_keep=0.8)


def shard(groups: list[Group], rank: int, world: int) -> list[Group]:
    return groups[rank::world]


def empty(groups: list[Group]) -> list[Group]:
    """The same groups with no active token anywhere."""
    return make_groups(SEED, [len(g) for g in groups], p_keep=0.0)


def train(
    normalizer: GlobalNormalizer,
    groups: list[Group],
    *,
    reduction: LossReduction | None = None,
    ddp: bool = False,
    sync: bool = True,
    on_empty_step: OnEmptyStep = "raise",
    start_step: int = 0,
    overlap: bool = True,
) -> dict[str, Any]:
    """One step; returns grads after sync, parameters after the step, stats and
    how many parameter gradients a backward computed. A failed step returns its
    error (see :func:`capture`) with that count and whether the parameters and
    gradients are untouched."""
    model: nn.Module = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    backwards = BackwardCounter(model)
    world = dist.get_world_size() if ddp else 1
    grad_sync: Callable[[nn.Module], None] | None = None
    if ddp:
        model = DistributedDataParallel(model)
    elif sync:

        def grad_sync(m: nn.Module) -> None:
            for p in m.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    engine = TorchTrainEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        normalizer,
        MicrobatchSplitter(MicrobatchSettings(n_microbatches=2)),
        forward_fn=forward,
        on_empty_step=on_empty_step,
        grad_average_world_size=world,
        grad_sync=grad_sync,
        start_step=start_step,
        overlap=overlap,
    )
    try:
        stats = engine.train_batch_with_reduction(
            build_batch(groups, packed=True), reduction or make_reduction(THREE_TERMS)
        )
    except LossReduceError as err:
        untouched = all(
            p.grad is None and torch.equal(p.detach(), old)
            for p, old in zip(model.parameters(), before, strict=True)
        )
        return {**described(err), "backwards": backwards.count, "untouched": untouched}
    return {
        "grads": grads_of(model),
        "params": [p.detach().clone() for p in model.parameters()],
        "stats": stats.as_dict(),
        "skipped": stats.skipped,
        "backwards": backwards.count,
    }


class BackwardCounter:
    """Counts the parameter gradients backward computes (a hook per parameter)."""

    def __init__(self, model: nn.Module) -> None:
        self.count = 0
        for param in model.parameters():
            param.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return grad


def described(err: LossReduceError) -> dict[str, Any]:
    return {
        "error": type(err).__name__,
        "message": str(err),
        "rank": err.rank,
        "ranks": err.ranks,
        "terms": err.terms,
    }


def capture(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except LossReduceError as err:
        return described(err)


def nan_on_rank(bad_rank: int) -> LossReduction:
    """One mean term whose normalizer is NaN on ``bad_rank`` (a bug on that rank)."""
    rank = dist.get_rank()
    base = make_reduction([TermSpec("pg", "token_mean", channel=0)])
    counts = base.terms[0].normalizer_fn

    def normalizer(mb: Any) -> torch.Tensor:
        return torch.tensor(float("nan")) if rank == bad_rank else counts(mb)

    return LossReduction(base.loss_fn, [LossTerm("pg", normalizer, "mean", base.terms[0].contract)])


def malformed_on_rank_0(normalizer: GlobalNormalizer, rank: int, step: int) -> dict[str, Any]:
    """Rank 0 sends a contract for a term it has no partial for."""
    contracts = {"kl" if rank == 0 else "pg": "mean"}
    normalizers = normalizer.reduce(step, {"pg": torch.tensor(1.0)}, contracts)
    return {"normalizers": normalizers}


UNSORTED_TERMS = ("pg", "kl", "ent")


def term_order(normalizer: GlobalNormalizer, step: int) -> dict[str, Any]:
    """The order the backend returns terms in, for partials given in :data:`UNSORTED_TERMS`."""
    partials = {t: torch.tensor(float(i + 1)) for i, t in enumerate(UNSORTED_TERMS)}
    return {"terms": list(normalizer.reduce(step, partials))}


def timed(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """:func:`capture` plus how long the call took (``seconds``)."""
    start = time.monotonic()
    result = capture(fn)
    return {**result, "seconds": time.monotonic() - start}


def mismatched_contract(rank: int) -> LossReduction:
    """Rank 0 declares another contract for ``pg`` than its peers."""
    return make_reduction([TermSpec("pg", "seq_mean" if rank == 0 else "token_mean", channel=0)])


def scenarios(rank: int, world: int, target: str | None) -> dict[str, dict[str, Any]]:
    groups = all_groups()
    mine = shard(groups, rank, world)
    torch_backend = TorchDistributedNormalizer(job="dist", group="actor")
    out = {
        "torch_sum": capture(lambda: train(torch_backend, mine)),
        "torch_ddp": capture(lambda: train(torch_backend, mine, ddp=True)),
        "torch_sum_serial": capture(lambda: train(torch_backend, mine, overlap=False)),
        "torch_ddp_serial": capture(lambda: train(torch_backend, mine, ddp=True, overlap=False)),
        "torch_empty_raise": capture(lambda: train(torch_backend, empty(mine))),
        "torch_empty_skip": capture(
            lambda: train(torch_backend, empty(mine), on_empty_step="skip")
        ),
        "torch_invalid": capture(lambda: train(torch_backend, mine, reduction=nan_on_rank(1))),
        "torch_mismatch": capture(
            lambda: train(torch_backend, mine, reduction=mismatched_contract(rank))
        ),
        "torch_malformed": capture(lambda: malformed_on_rank_0(torch_backend, rank, 99)),
        "torch_order": capture(lambda: term_order(torch_backend, 100)),
    }
    if target is not None:
        from lossreduce.client import ReductionClient

        with ReductionClient(
            target, job="dist-coord", group=f"w{world}", rank=rank, world_size=world
        ) as client:
            coord = CoordinatorNormalizer(client)
            out["coord_sum"] = capture(lambda: train(coord, mine, start_step=0))
            out["coord_empty_raise"] = capture(lambda: train(coord, empty(mine), start_step=1))
            out["coord_empty_skip"] = capture(
                lambda: train(coord, empty(mine), on_empty_step="skip", start_step=2)
            )
            out["coord_invalid"] = capture(
                lambda: train(coord, mine, reduction=nan_on_rank(1), start_step=3)
            )
            out["coord_malformed"] = timed(lambda: malformed_on_rank_0(coord, rank, 4))
            out["coord_mismatch"] = capture(
                lambda: train(coord, mine, reduction=mismatched_contract(rank), start_step=5)
            )
            out["coord_order"] = capture(lambda: term_order(coord, 6))
            out["coord_sum_serial"] = capture(
                lambda: train(coord, mine, start_step=7, overlap=False)
            )
    return out


def empty_rank_scenarios(rank: int) -> dict[str, dict[str, Any]]:
    """Rank 0 trains on all the groups; every other rank has no microbatches."""
    mine = all_groups() if rank == 0 else []
    backend = TorchDistributedNormalizer(job="dist", group="empty-rank")
    return {
        "torch_ddp": capture(lambda: train(backend, mine, ddp=True)),
        "torch_sum": capture(lambda: train(backend, mine)),
    }


def worker(rank: int, world: int, port: int, out_dir: str, target: str | None) -> None:
    """torch.multiprocessing.spawn entry point."""
    run_rank(rank, world, port, out_dir, lambda: scenarios(rank, world, target))


def empty_rank_worker(rank: int, world: int, port: int, out_dir: str, target: None) -> None:
    """Entry point for :func:`empty_rank_scenarios` (no coordinator: ``target`` is None)."""
    run_rank(rank, world, port, out_dir, lambda: empty_rank_scenarios(rank))


def run_rank(
    rank: int, world: int, port: int, out_dir: str, body: Callable[[], dict[str, Any]]
) -> None:
    """Run ``body`` in a gloo process group and save what it returns (or its crash)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        result = body()
        # Tear down only once every rank is done: a rank that destroyed its gloo group
        # while a peer's last collective was still in flight aborted that peer
        # ("terminate called without an active exception", SIGABRT), once in CI.
        dist.barrier()
    except Exception:
        torch.save({"crash": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
        raise
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # Every rank is past the barrier and its result is on disk: leave without tearing
    # gloo down. With torch 2.10 (the floor of the range) a rank aborted with the same
    # SIGABRT in that teardown after both had saved complete results, failing a test
    # whose numbers were all there.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
