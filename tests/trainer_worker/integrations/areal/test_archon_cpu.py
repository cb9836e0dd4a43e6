"""``archon_cpu_config`` sets Archon's two CPU settings on a real AReaL actor config, and
refuses a micro-batch budget whose padding would run past the model's rope cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lossreduce.trainer_worker.cpu_standins.areal.archon import (
    ARCHON_CPU_OVERRIDES,
    archon_cpu_config,
)
from tests.trainer_worker.integrations.areal import areal_runs


def _config(model_dir: Path, max_tokens: int) -> Any:
    from areal.api.cli_args import MicroBatchSpec, PPOActorConfig

    return PPOActorConfig(
        experiment_name="e",
        trial_name="t",
        path=str(model_dir),
        backend="archon:d1",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
    )


def test_archon_cpu_config_sets_sdpa_and_pad_to_maximum(tmp_path: Path) -> None:
    config = _config(areal_runs.save_model(tmp_path), 64)  # the model's 64 positions
    assert archon_cpu_config(config) is config
    assert config.archon.attn_type == "sdpa"
    assert config.pad_to_maximum is True
    # The launch overrides name the same two keys.
    assert ARCHON_CPU_OVERRIDES == ("++actor.archon.attn_type=sdpa", "++actor.pad_to_maximum=true")


def test_a_budget_past_the_rope_cache_is_refused(tmp_path: Path) -> None:
    config = _config(areal_runs.save_model(tmp_path), 65)
    with pytest.raises(ValueError, match="max_tokens_per_mb=65 is above the model's max_position"):
        archon_cpu_config(config)
    assert config.pad_to_maximum is False  # left as it was
