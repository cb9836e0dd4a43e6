"""TRL's row of the contract table (:mod:`tests.contract.table`): ``LossReduceGRPOTrainer``
on the tiny offline GRPO setup of :mod:`tiny_grpo`, one process (12 completions a step) and
two gloo processes (6 each), one optimizer step per generation batch.

A case's update is its last optimizer step's (each parameter after it minus before it);
its normalizers are those the trainer logged for that step's round. The empty cases are
those of ``test_trl_grpo.py``: a first step trains under AdamW, the second has only
truncated (masked) completions, so its optimizer holds momentum that would move the
weights if the empty step reached it. TRL computes the advantages itself (a NaN becomes
0), so the NaN cases set one after TRL scored the batch (``trl_runs._poison_advantage``),
as a trainer subclass with advantages of its own would.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="needs the trl extra: pip install 'lossreduce[trl]'")

from lossreduce.ports import free_port
from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.contract.table import Case, RankOutcome, cached_runs, outcome_of
from tests.trainer_worker.integrations.trl import tiny_grpo
from tests.trainer_worker.integrations.trl.trl_runs import Case as TrlCase
from tests.trainer_worker.integrations.trl.trl_runs import Layout, run

pytestmark = [
    # transformers and TRL announce their own deprecations while a trainer is built.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*experimental.*:UserWarning"),
]

LAYOUTS = {
    1: Layout("1x1", processes=1, per_device=12, accumulation=1, steps_per_generation=1),
    2: Layout("2x1", processes=2, per_device=6, accumulation=1, steps_per_generation=1),
}


def empty(name: str, on_empty_step: str) -> TrlCase:
    """Step 1 trains, step 2 has only truncated (masked) completions; AdamW."""
    return TrlCase(
        name=name,
        optim="adamw_torch",
        max_steps=2,
        empty_from_step=1,
        on_empty_step=on_empty_step,
    )


def cases(world: int, target: str) -> list[TrlCase]:
    """The contract's cases in TRL's harness (``mode='prompt_mean'``, KL and entropy on)."""
    both = [
        TrlCase(Case.CLEAN.value, mode="prompt_mean"),
        empty(Case.EMPTY_RAISE.value, "raise"),
        empty(Case.EMPTY_SKIP.value, "skip"),
        TrlCase(Case.NAN_MASKED.value, mode="prompt_mean", nan_advantage="masked"),
    ]
    if world == 1:
        return both
    return [
        *both,
        TrlCase(Case.NAN_ACTIVE.value, mode="prompt_mean", nan_advantage="active"),
        TrlCase(Case.RANK_WITHOUT_TOKENS.value, mode="seq_mean", truncated_processes=(1,)),
        TrlCase(
            Case.COORDINATOR.value, mode="prompt_mean", normalizer="coordinator", coordinator=target
        ),
    ]


class TrlRow:
    name = "trl"

    def __init__(self, results: Callable[[int], list[dict[str, Any]]]) -> None:
        self.results = results

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        return [
            outcome_of({**r[case.value], "update": r[case.value]["step_update"]})
            for r in self.results(world)
        ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_grpo.save_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def contract(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> TrlRow:
    def results(world: int) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(f"contract-{world}")
        return run(LAYOUTS[world], cases(world, coordinator_target), model_dir, out, free_port())

    return TrlRow(cached_runs(results, "TRL contract processes"))


def test_a_nan_advantage_is_named_by_its_row_as_trl_generated_it(contract: TrlRow) -> None:
    """TRL shuffles each process's generation batch before it splits it into micro-steps
    (``shuffle_sequence_dict``, always): the refusal names the poisoned row by its place in
    the generation batch as generated, on process 1 of 2 (6 rows each), not by where the
    shuffle put it."""
    culprit = contract.results(2)[1][Case.NAN_ACTIVE.value]
    row = culprit["poisoned_row"]
    assert row is not None
    message = culprit["error"]["message"]
    assert f"of rank 1 rows [{row}] (generation-batch rows [{6 + row}])" in message, message
