"""``lossreduce train --engine verl``: verl's real actor worker as the main job on Ray workers.

Runs in ``.venv-verl`` (``make test-verl``). The Ray runs share one local
cluster (2 CPUs) and use the tiny settings below: 2 workers, each running
verl's ``TrainingWorker`` (FSDP2, gloo, lossreduce's CPU platform) with
``LossReduceTrainingWorker``; a few steps with the coordinator actor and with
torch.distributed, and ``--verify`` against one verl worker in this process.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from lossreduce.trainer_worker.train.cli import PROG, main
from lossreduce.trainer_worker.train.driver import RunResult, run
from lossreduce.trainer_worker.train.engines.registry import get_engine
from lossreduce.trainer_worker.train.engines.verl.engine import VerlEngine
from lossreduce.trainer_worker.train.engines.verl.worker import padded_rows
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from tests.conftest import flag_error
from tests.ray_support import local_ray

TINY: dict[str, Any] = {
    "engine": "verl",
    "workers": 2,
    "prompts_per_step": 4,
    "samples_per_prompt": 4,
    "microbatches": 2,
    "d_model": 16,
    "heads": 2,
    "layers": 1,
    "steps": 3,
    "progress": False,
    "round_timeout_s": 10.0,
    "step_timeout_s": 180.0,
}


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


def _run(settings: TrainSettings) -> tuple[RunResult, str]:
    out = io.StringIO()
    result = run(settings, console=Console(file=out, width=200))
    return result, out.getvalue()


# -- no Ray ------------------------------------------------------------------------------


def test_model_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    message = flag_error(main, ["--engine", "verl", "--model", "/x"], capsys, PROG)
    assert "--model /x: --engine verl trains the built-in tiny Qwen2" in message


def test_the_engine_loads_with_verl_installed() -> None:
    assert get_engine("verl").load() is VerlEngine


@pytest.mark.parametrize(
    ("shards", "microbatches", "rows"),
    [([5, 3], 2, 6), ([4, 4], 2, 4), ([0, 0], 2, 2), ([7], 1, 7), ([1, 9], 4, 12)],
)
def test_every_rank_trains_on_as_many_rows_in_whole_micro_batches(
    shards: list[int], microbatches: int, rows: int
) -> None:
    assert padded_rows(shards, microbatches) == rows


# -- on Ray ----------------------------------------------------------------------------


@pytest.mark.ray
def test_verl_on_two_workers_with_the_coordinator_actor(ray_session: None, tmp_path: Path) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="coordinator", mode="prompt_mean", out=tmp_path)
    )
    assert printed.startswith("lossreduce train --engine verl: ")
    assert "normalizer coordinator at 127.0.0.1:" in printed
    assert "verl's FSDP2 actor (LossReduceTrainingWorker)" in printed
    assert [r.step for r in result.records] == [0, 1, 2]
    trained = [r for r in result.records if not r.skipped]
    assert trained, "every step was filtered out"
    for record in trained:
        # prompt_mean counts the kept prompt groups; the KL term the kept tokens.
        assert record.normalizers == {"pg": float(record.groups), "kl": float(record.tokens)}
        assert 0.0 <= record.reward <= 1.0
        assert all(math.isfinite(v) for v in record.losses.values())
        assert record.losses["kl"] >= 0.0
        assert record.round_latency_s > 0.0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert rows[0]["normalizers"] == result.records[0].normalizers
    assert (tmp_path / "plot.png").is_file()
    assert (tmp_path / "model" / "config.json").is_file()


@pytest.mark.ray
def test_verl_with_the_torch_normalizer(ray_session: None, tmp_path: Path) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="torch", mode="token_mean", out=tmp_path)
    )
    assert "normalizer torch" in printed
    assert len(result.records) == 3
    for record in result.records:
        if not record.skipped:
            # token_mean: the policy and KL terms both count every kept token.
            assert record.normalizers == {"pg": record.tokens, "kl": record.tokens}


@pytest.mark.ray
def test_verify_matches_one_verl_process_on_the_same_batch(
    ray_session: None, tmp_path: Path
) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="coordinator", mode="seq_mean", verify=True, out=tmp_path)
    )
    report = result.verify
    assert report is not None, printed
    assert report.world_size == 2
    assert report.passed, printed
    assert report.scale > 0
    assert abs(report.distributed_loss - report.single_loss) <= 1e-6 * max(
        1.0, abs(report.single_loss)
    )
    # A wrong normalizer would be off by a share of the gradient, far above the tolerance.
    assert report.max_abs_diff < 1e-3 * report.scale
    assert not torch.distributed.is_initialized()


def test_a_shard_is_verls_mini_batch_topped_up_with_rows_that_count_nowhere() -> None:
    from lossreduce.trainer_worker.train.engines.verl.batch import mini_batch
    from lossreduce.trainer_worker.train.rollouts import RolloutBatch

    # Two groups (3 and 2 responses) of a 1 + 3 token prompt and 4 response tokens.
    mask = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32
    )
    shard = RolloutBatch(
        tokens=torch.randint(0, 10, (5, 8)),
        loss_mask=mask,
        old_logprobs=torch.randn(5, 4),
        ref_logprobs=torch.randn(5, 4),
        advantages=torch.randn(5),
        group_sizes=(3, 2),
        prompt_len=4,
    )
    data = mini_batch(shard, [7, 2], rows=8, world_size=2, microbatches=2, temperature=1.0, rank=1)
    assert data.batch_size[0] == 8
    response_mask = data["response_mask"]
    response_mask = response_mask.to_padded_tensor(0) if response_mask.is_nested else response_mask
    assert response_mask.sum(-1).tolist() == [4, 2, 1, 3, 4, 0, 0, 0]
    assert list(data["uid"]) == [
        *["group-7"] * 3,
        *["group-2"] * 2,
        "pad-1-0",
        "pad-1-1",
        "pad-1-2",
    ]
    assert data["mini_batch_size"] == 16  # global: rows x ranks
    assert data["micro_batch_size_per_gpu"] == 4
    with pytest.raises(ValueError, match=r"rank 1: a shard of 5 rows in 2 groups does not fit 6"):
        mini_batch(shard, [7, 2], rows=6, world_size=2, microbatches=4, temperature=1.0, rank=1)


@pytest.mark.ray
def test_a_step_the_filter_empties_is_skipped_on_every_rank(
    ray_session: None, tmp_path: Path
) -> None:
    # Near-greedy sampling: every group's responses are identical, so the filter drops all.
    settings = TrainSettings(
        **{**TINY, "steps": 2}, temperature=1e-4, on_empty_step="skip", out=tmp_path
    )
    result, printed = _run(settings)
    assert [r.skipped for r in result.records] == [True, True], printed
    for record in result.records:
        assert record.responses == record.groups == record.tokens == 0
        assert record.losses == {}
        assert record.normalizers == {}
