"""SkyRL's row of the contract table (:mod:`tests.contract.table`): ``LossReducePolicyWorker``
on SkyRL's FSDP strategy, one policy mini-batch of :mod:`tiny_skyrl` per case
(``forward_backward`` then ``optim_step``), on one and two gloo ranks with micro-batches
of 2 rows.

A case's update is what SkyRL's optimizer step changed in each parameter (SGD with lr 1,
AdamW for the skipped empty step, whose weight decay would move every weight if it ran).
Where ``forward_backward`` raised, SkyRL's trainer never reaches ``optim_step``: the update
is then what SGD with lr 1 would apply with the gradients the failed call left (none where
it raised before any backward).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.contract.table import Case, RankOutcome, cached_runs, outcome_of
from tests.trainer_worker.integrations.skyrl import tiny_skyrl
from tests.trainer_worker.integrations.skyrl.skyrl_runs import Case as SkyrlCase
from tests.trainer_worker.integrations.skyrl.skyrl_runs import run

MICRO = 2
"""Rows per micro-batch: 4 micro-batches on one rank, 2 on each of two."""


def cases(world: int, target: str) -> list[SkyrlCase]:
    """The contract's cases in SkyRL's harness: the batches of :func:`skyrl_runs.batch_of`
    (KL and entropy losses on)."""
    sgd: dict[str, Any] = {"optimizer": "sgd", "step": True}
    both = [
        SkyrlCase(Case.CLEAN.value, mode="prompt_mean", **sgd),
        SkyrlCase(Case.EMPTY_RAISE.value, batch="all_masked", **sgd),
        SkyrlCase(
            Case.EMPTY_SKIP.value,
            batch="all_masked",
            on_empty_step="skip",
            optimizer="adamw",
            step=True,
        ),
        SkyrlCase(Case.NAN_MASKED.value, mode="prompt_mean", batch="masked_nan", **sgd),
    ]
    if world == 1:
        return both
    return [
        *both,
        SkyrlCase(Case.NAN_ACTIVE.value, mode="prompt_mean", batch="nan_advantage", **sgd),
        SkyrlCase(Case.RANK_WITHOUT_TOKENS.value, mode="seq_mean", batch="rank1_masked", **sgd),
        SkyrlCase(
            Case.COORDINATOR.value,
            mode="prompt_mean",
            normalizer="coordinator",
            coordinator=target,
            **sgd,
        ),
    ]


def outcome(result: dict[str, Any]) -> RankOutcome:
    if result["error"] is None:
        update = result["update"]
    else:
        update = {n: -grad for n, grad in result["grads_left"].items()}
    return outcome_of({**result, "update": update, "error": result.get("error_info")})


class SkyrlRow:
    name = "skyrl"

    def __init__(self, results: Callable[[int], list[dict[str, Any]]]) -> None:
        self.results = results

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        return [outcome(r[case.value]) for r in self.results(world)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_skyrl.save_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def contract(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> SkyrlRow:
    def results(world: int) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(f"contract-dp{world}")
        return run(world, MICRO, cases(world, coordinator_target), model_dir, out)

    return SkyrlRow(cached_runs(results, "SkyRL contract world"))
