"""``lossreduce train --engine areal``: AReaL's FSDP PPO actor as the main job on Ray workers.

Runs in ``.venv-areal`` (``make test-areal``). The Ray runs share one local
cluster (2 CPUs) and use the tiny settings below: 2 workers, 2 optimizer
steps with the coordinator actor and with torch.distributed, an empty step
and a rank without prompt groups, and ``--verify``; each worker runs the real AReaL 1.0.4 ``FSDPPPOActor`` (with
the LossReduce mixin) on gloo.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("areal")

from rich.console import Console

from lossreduce.trainer_worker.train.driver import RunResult, run
from lossreduce.trainer_worker.train.engines.base import Engine
from lossreduce.trainer_worker.train.engines.registry import get_engine
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from tests.ray_support import local_ray

TINY: dict[str, Any] = {
    "engine": "areal",
    "workers": 2,
    "prompts_per_step": 4,
    "samples_per_prompt": 4,
    "microbatches": 2,
    "d_model": 16,
    "heads": 2,
    "layers": 1,
    "steps": 2,
    "progress": False,
    "round_timeout_s": 10.0,
    "step_timeout_s": 180.0,
}


def test_the_registered_engine_loads_a_factory_with_the_interface() -> None:
    factory = get_engine("areal").load()
    for method in ("start", "describe", "train", "verify", "shutdown"):
        assert callable(getattr(factory, method)), method
        assert method in Engine.__dict__


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


def _run(settings: TrainSettings) -> tuple[RunResult, str]:
    out = io.StringIO()
    result = run(settings, console=Console(file=out, width=200))
    return result, out.getvalue()


@pytest.mark.ray
def test_areal_on_two_workers_with_the_coordinator_actor(ray_session: None, tmp_path: Path) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="coordinator", mode="prompt_mean", out=tmp_path)
    )
    assert "--engine areal" in printed
    assert "normalizer coordinator" in printed
    assert "AReaL FSDPPPOActor" in printed
    assert [r.step for r in result.records] == [0, 1]
    for record in result.records:
        assert not record.skipped
        # prompt_mean: every kept prompt group has a loss token, and counts once.
        assert record.normalizers == {"pg": float(record.groups)}
        assert 1 <= record.groups <= 4
        assert record.groups * 2 <= record.responses <= 16
        assert 0.0 <= record.reward <= 1.0
        assert set(record.losses) == {"pg"}
        assert math.isfinite(record.losses["pg"])
        assert record.round_latency_s > 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert (tmp_path / "plot.png").is_file()
    # AReaL's actor loads the policy and its tokenizer from this folder.
    assert (tmp_path / "model" / "config.json").is_file()
    assert (tmp_path / "model" / "tokenizer.json").is_file()


@pytest.mark.ray
def test_areal_with_the_torch_normalizer(ray_session: None, tmp_path: Path) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="torch", mode="token_mean", kl_coef=0.0, out=tmp_path)
    )
    assert "normalizer torch" in printed
    assert len(result.records) == 2
    for record in result.records:
        # token_mean: the global normalizer is every kept loss token of the step.
        assert record.normalizers == {"pg": float(record.tokens)}
        assert record.tokens >= record.responses


@pytest.mark.ray
def test_verify_matches_a_one_rank_areal_replay(ray_session: None, tmp_path: Path) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="coordinator", mode="seq_mean", verify=True, out=tmp_path)
    )
    report = result.verify
    assert report is not None
    assert report.world_size == 2
    assert report.passed, printed
    assert report.scale > 0
    assert len(report.diffs) > 10  # every parameter of the tiny Qwen2
    assert abs(report.distributed_loss - report.single_loss) <= 1e-6 * max(
        1.0, abs(report.single_loss)
    )


@pytest.mark.ray
def test_an_empty_step_is_skipped_and_a_rank_without_groups_takes_part(
    ray_session: None, tmp_path: Path
) -> None:
    # Seed 21 draws, from the initial policy, two prompts whose responses the filter drops
    # at step 0 (an empty step: skipped on every rank, the policy unchanged), then one
    # prompt group at step 1, so that rank 1 holds no group and trains on rows without a
    # loss token.
    tiny = {**TINY, "prompts_per_step": 2, "samples_per_prompt": 2, "seed": 21}
    result, _ = _run(
        TrainSettings(**tiny, normalizer="coordinator", mode="prompt_mean", out=tmp_path)
    )
    empty, single = result.records
    assert empty.skipped
    assert (empty.groups, empty.losses, empty.normalizers) == (0, {}, {})
    assert not single.skipped
    assert single.groups == 1 < TINY["workers"]
    assert single.normalizers == {"pg": 1.0}
    assert math.isfinite(single.losses["pg"])
