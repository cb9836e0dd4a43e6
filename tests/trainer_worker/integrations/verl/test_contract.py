"""verl's row of the contract table (:mod:`tests.contract.table`): the actor's
``LossReduceTrainingWorker`` on verl's FSDP engine, one PPO mini-batch per case on the
tiny Qwen2 of :mod:`tiny_verl`, on one and two gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.contract.table import Case, RankOutcome, outcome_of
from tests.trainer_worker.integrations.verl.verl_runs import Case as VerlCase
from tests.trainer_worker.integrations.verl.verl_runs import LayoutRuns


def cases(world: int, target: str) -> list[VerlCase]:
    """The contract's cases in verl's harness: the batches of :func:`verl_runs.batch_of`."""
    both = [
        VerlCase(Case.CLEAN.value, mode="prompt_mean"),
        VerlCase(Case.EMPTY_RAISE.value, batch="all_masked"),
        VerlCase(
            Case.EMPTY_SKIP.value, batch="all_masked", on_empty_step="skip", optimizer="adamw"
        ),
        VerlCase(Case.NAN_MASKED.value, mode="prompt_mean", batch="masked_nan"),
    ]
    if world == 1:
        return both
    return [
        *both,
        VerlCase(Case.NAN_ACTIVE.value, mode="prompt_mean", batch="nan_advantage"),
        VerlCase(Case.RANK_WITHOUT_TOKENS.value, mode="seq_mean", batch="rank1_masked"),
        VerlCase(
            Case.COORDINATOR.value, mode="prompt_mean", normalizer="coordinator", coordinator=target
        ),
    ]


class VerlRow:
    name = "verl"

    def __init__(self, runs: LayoutRuns) -> None:
        self.runs = runs

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        return [outcome_of(r) for r in self.runs.case(world, case.value, ok=False)]


@pytest.fixture(scope="module")
def contract(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> VerlRow:
    return VerlRow(
        LayoutRuns(
            lambda world: cases(world, coordinator_target),
            model_dir,
            tmp_path_factory.mktemp("contract"),
        )
    )
