"""verl on Megatron's row of the contract table (:mod:`tests.contract.table`): the
actor's ``LossReduceTrainingWorker`` on verl's ``MegatronEngine`` (Megatron-Core through
mbridge, the CPU stand-ins), one PPO mini-batch per case on the tiny Qwen2, data-parallel
on one and two gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lossreduce.ports import free_port
from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.contract.table import Case, RankOutcome, outcome_of
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

    def __init__(self, model_dir: Path, target: str, out: Path) -> None:
        self.model_dir, self.target, self.out = model_dir, target, out
        self._cache: dict[int, list[dict[str, Any]]] = {}

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        if world not in self._cache:
            layout = f"dp{world}"
            job = Job(
                layout,
                cases(world, self.target),
                str(self.model_dir),
                str(self.out / layout),
                free_port(),
            )
            with pytest.MonkeyPatch.context() as patch:
                # Spawned ranks import the run module (and verl its stand-ins) by name.
                patch.syspath_prepend(str(Path(__file__).resolve().parents[5]))
                self._cache[world] = run(job)
        per_rank = []
        for rank, results in enumerate(self._cache[world]):
            assert "crash" not in results, f"dp{world} rank {rank}: {results['crash']}"
            result = results[case.value]
            assert "init_error" not in result, f"dp{world} {case.value} rank {rank}: {result}"
            per_rank.append(outcome_of(result))
        return per_rank


@pytest.fixture(scope="module")
def contract(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> VerlMegatronRow:
    model_dir = save_model(tmp_path_factory.mktemp("tiny-qwen2"))
    return VerlMegatronRow(model_dir, coordinator_target, tmp_path_factory.mktemp("contract"))
