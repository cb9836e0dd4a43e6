"""``archon_cpu_config`` sets Archon's two CPU settings on a real AReaL actor config, and
refuses a micro-batch budget whose padding would run past the model's rope cache: one
above the model's positions, or none (AReaL's default ``MicroBatchSpec()``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.cpu_standins.areal.archon import (
    ARCHON_CPU_OVERRIDES,
    archon_cpu_config,
)
from tests.trainer_worker.integrations.areal import areal_runs


def _config(model_dir: Path, max_tokens: int | None) -> Any:
    from areal.api.cli_args import MicroBatchSpec, PPOActorConfig

    return PPOActorConfig(
        experiment_name="e",
        trial_name="t",
        path=str(model_dir),
        backend="archon:d1",
        mb_spec=MicroBatchSpec()
        if max_tokens is None
        else MicroBatchSpec(max_tokens_per_mb=max_tokens),
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
    with pytest.raises(
        ReductionConfigError, match="max_tokens_per_mb=65 is above the model's max_position"
    ):
        archon_cpu_config(config)
    assert config.pad_to_maximum is False  # left as it was


def test_areals_default_micro_batch_spec_is_refused(tmp_path: Path) -> None:
    # MicroBatchSpec() has no token budget: AReaL would drop pad_to_maximum and pad to a
    # whole page, past the rope cache (an IndexError in the first forward).
    config = _config(areal_runs.save_model(tmp_path), None)
    assert config.mb_spec.max_tokens_per_mb is None
    with pytest.raises(ReductionConfigError) as refused:
        archon_cpu_config(config)
    message = str(refused.value)
    assert message.startswith("mb_spec.max_tokens_per_mb=None")
    assert "at most the model's max_position_embeddings=64" in message
    assert config.pad_to_maximum is False
    assert config.archon.attn_type != "sdpa"  # left as it was
