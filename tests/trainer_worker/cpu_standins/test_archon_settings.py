"""``archon_cpu_config`` without AReaL: it reads only ``mb_spec``, ``path``, ``archon``
and ``pad_to_maximum`` of the config (and imports no AReaL), so a namespace in the shape
of AReaL's ``PPOActorConfig`` stands in for it here. The real config is checked in the
AReaL environment (tests/trainer_worker/integrations/areal/test_archon_cpu.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.cpu_standins.areal.archon import archon_cpu_config


def _config(tmp_path: Path, max_tokens: int | None) -> SimpleNamespace:
    from transformers import Qwen2Config

    Qwen2Config(max_position_embeddings=64).save_pretrained(tmp_path)
    return SimpleNamespace(
        path=str(tmp_path),
        mb_spec=SimpleNamespace(max_tokens_per_mb=max_tokens),
        archon=SimpleNamespace(attn_type="varlen"),
        pad_to_maximum=False,
    )


def test_a_budget_within_the_positions_gets_sdpa_and_pad_to_maximum(tmp_path: Path) -> None:
    config = _config(tmp_path, 64)
    assert archon_cpu_config(config) is config
    assert (config.archon.attn_type, config.pad_to_maximum) == ("sdpa", True)


@pytest.mark.parametrize(
    ("max_tokens", "message"),
    [
        (
            None,
            r"^mb_spec\.max_tokens_per_mb=None .* set mb_spec\.max_tokens_per_mb "
            r"\(actor\.mb_spec\.max_tokens_per_mb in a launch\) to at most the model's "
            r"max_position_embeddings=64$",
        ),
        (65, r"^mb_spec\.max_tokens_per_mb=65 is above the model's max_position_embeddings=64"),
    ],
)
def test_no_budget_or_one_past_the_rope_cache_is_refused(
    tmp_path: Path, max_tokens: int | None, message: str
) -> None:
    config = _config(tmp_path, max_tokens)
    with pytest.raises(ReductionConfigError, match=message):
        archon_cpu_config(config)
    assert (config.archon.attn_type, config.pad_to_maximum) == ("varlen", False)
