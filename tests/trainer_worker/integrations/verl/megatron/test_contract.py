"""verl on Megatron's row of the contract table (:mod:`tests.contract.table`): the
actor's ``LossReduceTrainingWorker`` on verl's ``MegatronEngine`` (Megatron-Core through
mbridge, the CPU stand-ins), one PPO mini-batch per case on the tiny Qwen2, data-parallel
on one and two gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lossreduce.ports import free_port
from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.contract.table import Case, RankOutcome, cached_runs, outcome_of
from tests.trainer_worker.integrations.verl.megatron.megatron_runs import (
    Job,
    MegatronCase,
    run,
    save_model,
)


def cases(world: int, target: str) -> list[MegatronCase]:
    """The contract's cases in the Megatron harness (micro-batches of one row)."""
    both = [
        MegatronCase(Case.CLEAN.value, mode="prompt_mean", micro=1),
        MegatronCase(Case.EMPTY_RAISE.value, batch="all_masked"),
        MegatronCase(
            Case.EMPTY_SKIP.value, batch="all_masked", on_empty_step="skip", optimizer="adamw"
        ),
        MegatronCase(Case.NAN_MASKED.value, mode="prompt_mean", micro=1, batch="masked_nan"),
    ]
    if world == 1:
        return both
    return [
        *both,
        MegatronCase(Case.NAN_ACTIVE.value, mode="prompt_mean", batch="nan_advantage"),
        MegatronCase(Case.RANK_WITHOUT_TOKENS.value, mode="seq_mean", batch="rank1_masked"),
        MegatronCase(
            Case.COORDINATOR.value,
            mode="prompt_mean",
            micro=1,
            normalizer="coordinator",
            coordinator=target,
        ),
    ]


class VerlMegatronRow:
    name = "verl-megatron"

    def __init__(self, results: Callable[[int], list[dict[str, Any]]]) -> None:
        self.results = results

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        per_rank = []
        for rank, results in enumerate(self.results(world)):
            result = results[case.value]
            assert "init_error" not in result, f"dp{world} {case.value} rank {rank}: {result}"
            per_rank.append(outcome_of(result))
        return per_rank


@pytest.fixture(scope="module")
def contract(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> VerlMegatronRow:
    model_dir = save_model(tmp_path_factory.mktemp("tiny-qwen2"))

    def results(world: int) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(f"contract-dp{world}")
        return run(
            Job(
                f"dp{world}",
                cases(world, coordinator_target),
                str(model_dir),
                str(out),
                free_port(),
            )
        )

    return VerlMegatronRow(cached_runs(results, "verl Megatron contract world"))
