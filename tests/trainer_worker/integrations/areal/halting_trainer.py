"""``LossReducePPOTrainer`` that stops after a given step's recover checkpoint, until killed.

``resume_runs.py`` launches ``grpo_launch.py`` with its import turned to this class
for the run it then SIGKILLs: the run trains and checkpoints exactly as the
LossReduce trainer does, and after the checkpoint of step ``HALT_AFTER_ENV``
(1-based) every rank writes ``<HALT_DIR_ENV>/rank<RANK>`` and sleeps. The kill
then lands at a known point, after that step's checkpoint and before any of the
next step's rollout or rounds (AReaL pauses its rollout from the weight update
until the stats are committed), whatever the machine's load.

One more test-only change, made when the trainer is built: a step's rollout waits for
its results without AReaL's one-second poll. ``BatchTaskDispatcher.active_submit_and_wait``
polls ``wait_results(timeout=1)`` and, after each timeout, draws more prompts into its
queue, up to the next step's. AReaL's recover checkpoint records the data loader's
position with those prompts drawn, so a run killed with prompts drawn ahead resumes
without them and trains other prompts than an uninterrupted run, depending on how fast
the rollout answered. Without the poll the killed run draws exactly its steps' prompts
(the test checks the checkpoint); what it trains is unchanged, since an uninterrupted
run trains the prompts in the same order either way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from areal.infra.workflow_executor import BatchTaskDispatcher

from lossreduce.trainer_worker.integrations.areal import LossReducePPOTrainer

__all__ = ["HALT_AFTER_ENV", "HALT_DIR_ENV", "HaltingPPOTrainer"]

HALT_AFTER_ENV = "RESUME_TEST_HALT_AFTER"
HALT_DIR_ENV = "RESUME_TEST_HALT_DIR"
_SLEEP_S = 3600.0  # far past any test's timeout: only the kill ends it

_polled_wait = BatchTaskDispatcher.wait_results


def _wait_without_poll(
    self: Any, count: int, timeout: float | None = None, raise_timeout: bool = True
) -> list[Any]:
    # None: AReaL's own default (a week); the launch's timeout ends a hang long before.
    results: list[Any] = _polled_wait(self, count, None, raise_timeout)
    return results


class HaltingPPOTrainer(LossReducePPOTrainer):
    """The LossReduce trainer, halting after the recover checkpoint of one step."""

    def __init__(self, config: Any, train_dataset: Any = None, valid_dataset: Any = None) -> None:
        # In the launched process only, before AReaL's init builds its rollout.
        BatchTaskDispatcher.wait_results = _wait_without_poll
        super().__init__(config, train_dataset, valid_dataset)

    def _save_recover_checkpoint(self, epoch: int, epoch_step: int, global_step: int) -> None:
        super()._save_recover_checkpoint(
            epoch=epoch, epoch_step=epoch_step, global_step=global_step
        )
        if global_step + 1 != int(os.environ[HALT_AFTER_ENV]):
            return
        marker = Path(os.environ[HALT_DIR_ENV]) / f"rank{os.environ['RANK']}"
        marker.write_text(str(global_step))
        time.sleep(_SLEEP_S)
