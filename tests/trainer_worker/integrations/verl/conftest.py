"""verl in the test process: its CPU platform, and its import-time warnings filtered exactly.

verl warns on import for every optional engine it cannot load here (Megatron,
TorchTitan, VeOmni, ...) and through Ray's deprecated state API; the pytest
config turns warnings into errors, so verl is imported once here with exactly
those filtered. The ranks the tests spawn set the same environment themselves.

The one ``main_ppo`` launch two test modules share lives here too: the trainer mode with
``clip_cov`` (:data:`~.main_ppo_launch.CLIP_COV`) through the job's own coordinator actor,
with verl's default job, in float32, one mini-batch a step, never interrupted. It is
``test_main_ppo_losses.py``'s statistics launch (the draw over each whole mini-batch)
and the uninterrupted run the resumed ones must equal, draw included
(``test_main_ppo_resume.py``, its third step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lossreduce.trainer_worker.cpu_standins.verl.launch import save_model, save_value_model
from tests.trainer_worker.integrations.verl.main_ppo_launch import (
    CLIP_COV,
    COMPUTE_IN_FLOAT32,
    ONE_MINI_BATCH,
    STEPS,
    Launch,
    launched,
)
from tests.trainer_worker.integrations.verl.verl_runs import VALUE_MODEL, prepare_test_process

prepare_test_process()


@pytest.fixture(scope="session")
def clip_cov_float32(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """``main_ppo`` with the trainer mode and ``clip_cov`` (``token_mean``, the job's own
    coordinator actor, verl's default job: ``verl-ppo-<run>``) in float32, one mini-batch
    a step, :data:`STEPS` steps without interruption."""
    folder: Path = tmp_path_factory.mktemp("clip-cov")
    args = [*COMPUTE_IN_FLOAT32, *CLIP_COV, "+actor_rollout_ref.lossreduce.normalizer=coordinator"]
    return launched(folder, args, STEPS, ONE_MINI_BATCH)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 the worker tests train, with the critic's value model in it."""
    folder = save_model(tmp_path_factory.mktemp("tiny-qwen2"))
    save_value_model(folder / VALUE_MODEL)
    return folder
