"""``lossreduce train --engine trl``: TRL's GRPO as the main job on Ray workers.

Flag and checkpoint checks run without Ray. The Ray runs share one local
cluster (2 CPUs) and use the tiny settings below: 2 workers, 2 optimizer
steps with the coordinator actor and with torch.distributed (the latter on a
``--model`` checkpoint the test writes with ``save_pretrained``), and
``--verify``.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import ray
from rich.console import Console
from transformers import PreTrainedTokenizerFast, ViTConfig

from lossreduce.bench.e2e import TRL_TARGET_RATIO, run_trl_e2e
from lossreduce.errors import UsageError
from lossreduce.trainer_worker.train.cli import PROG, main
from lossreduce.trainer_worker.train.driver import run
from lossreduce.trainer_worker.train.engines.trl.model import check_causal_lm
from lossreduce.trainer_worker.train.engines.trl.task import (
    DigitReward,
    digit_tokenizer,
    parse_digits,
    prompt_dataset,
    save_tiny_qwen2,
    task_of,
)
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import TrainingFailedError
from tests.conftest import flag_error
from tests.ray_support import local_ray

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*experimental.*:UserWarning"),
]

TINY: dict[str, Any] = {
    "engine": "trl",
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

ON_A_CHECKPOINT = {k: v for k, v in TINY.items() if k not in ("d_model", "heads", "layers")}
"""A --model checkpoint brings its own shape."""


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


def _checkpoint(folder: Path, *, pad: bool = True) -> Path:
    """A tiny Qwen2 saved with save_pretrained; ``pad=False`` drops the tokenizer's pad."""
    save_tiny_qwen2(TrainSettings(d_model=16, heads=2, layers=1), folder)
    if not pad:
        tokenizer = digit_tokenizer()
        bare = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>"
        )
        bare.save_pretrained(folder)
    return folder


# -- no Ray: flags, the task as text, checkpoints --------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--model", "/x"],
            "--model names a Hugging Face checkpoint, which --engine torch does not train",
        ),
        (
            ["--engine", "trl", "--model", "/x", "--d-model", "32"],
            "--d-model shapes the built-in model; --model /x brings its own",
        ),
        (
            ["--engine", "trl", "--prompts-per-step", "3", "--samples-per-prompt", "3"],
            "= 9 completions per step must split evenly into --workers 2 x --microbatches 2",
        ),
    ],
)
def test_flags_the_engine_cannot_honour_are_refused_in_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in flag_error(main, argv, capsys, PROG)


def test_the_digit_task_as_text_scores_like_the_token_task() -> None:
    settings = TrainSettings()
    data = prompt_dataset(settings, 3)
    assert all(len(p.split()) == settings.prompt_len for p in data["prompt"])
    reward = DigitReward(task_of(settings))
    target = data["target"][0]
    right, wrong_last = target, " ".join([*target.split()[:-1], "x"])
    assert reward([right, wrong_last, "", "<eos>"], [target] * 4) == [1.0, 0.75, 0.0, 0.0]
    assert parse_digits("1 2", 4) == [1, 2, 10, 10]


def test_a_checkpoint_is_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such directory"):
        check_causal_lm(tmp_path / "missing")
    with pytest.raises(UsageError, match="not a Hugging Face checkpoint"):
        check_causal_lm(tmp_path)
    vision = tmp_path / "vit"
    ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(vision)
    with pytest.raises(UsageError, match=r"found a 'vit' model .* not a causal LM"):
        check_causal_lm(vision)
    assert check_causal_lm(_checkpoint(tmp_path / "ok")) == ()
    (note,) = check_causal_lm(_checkpoint(tmp_path / "nopad", pad=False))
    assert "no pad token among the model's 12 token ids; padding with EOS '<eos>'" in note
    neither = tmp_path / "neither"
    _checkpoint(neither)
    PreTrainedTokenizerFast(tokenizer_object=digit_tokenizer().backend_tokenizer).save_pretrained(
        neither
    )
    with pytest.raises(UsageError, match="neither a pad token nor an EOS token among"):
        check_causal_lm(neither)


def test_a_bad_model_fails_before_ray_starts(tmp_path: Path) -> None:
    settings = TrainSettings(**ON_A_CHECKPOINT, model=tmp_path / "missing", out=tmp_path / "out")
    with pytest.raises(TrainingFailedError, match="no such directory"):
        run(settings, console=Console(file=io.StringIO()))
    assert not ray.is_initialized()


def test_a_missing_or_untested_trl_fails_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "lossreduce.trainer_worker.train.engines.trl.engine", None)
    with pytest.raises(TrainingFailedError, match=r"^--engine trl: "):
        run(TrainSettings(**TINY, out=tmp_path), console=Console(file=io.StringIO()))
    assert not ray.is_initialized()


# -- on Ray ----------------------------------------------------------------------------


def _run(settings: TrainSettings) -> tuple[Any, str]:
    out = io.StringIO()
    result = run(settings, console=Console(file=out, width=200))
    return result, out.getvalue()


@pytest.mark.ray
def test_trl_on_two_workers_with_the_coordinator_actor(ray_session: None, tmp_path: Path) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="coordinator", mode="prompt_mean", out=tmp_path)
    )
    assert "--engine trl" in printed
    assert "normalizer coordinator" in printed
    assert [r.step for r in result.records] == [0, 1]
    for record in result.records:
        assert not record.skipped
        # 4 prompt groups per step, whole, over both workers.
        assert record.normalizers["pg"] == 4.0
        assert record.normalizers["kl"] > 0
        assert 0.0 <= record.reward <= 1.0
        assert record.responses == 16
        assert record.groups == 4
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert (tmp_path / "plot.png").is_file()
    assert (tmp_path / "model" / "config.json").is_file()  # TRL's KL reference loads it


@pytest.mark.ray
def test_trl_with_torch_distributed_on_a_saved_checkpoint(
    ray_session: None, tmp_path: Path
) -> None:
    model = _checkpoint(tmp_path / "ckpt", pad=False)
    settings = TrainSettings(
        **ON_A_CHECKPOINT,
        model=model,
        normalizer="torch",
        mode="token_mean",
        out=tmp_path / "out",
    )
    result, printed = _run(settings)
    assert "padding with EOS" in printed
    assert str(model) in printed
    assert len(result.records) == 2
    # token_mean: the policy and KL terms count the same tokens.
    for record in result.records:
        assert record.normalizers["pg"] == record.normalizers["kl"] > 0


@pytest.mark.ray
def test_verify_matches_one_process_on_the_same_completions(
    ray_session: None, tmp_path: Path
) -> None:
    result, printed = _run(
        TrainSettings(**TINY, normalizer="coordinator", mode="seq_mean", verify=True, out=tmp_path)
    )
    report = result.verify
    assert report is not None
    assert report.world_size == 2
    assert report.passed, printed
    assert report.scale > 0
    assert abs(report.distributed_loss - report.single_loss) <= 1e-6 * max(
        1.0, abs(report.single_loss)
    )


# -- lossreduce bench --e2e ---------------------------------------------------------------


def test_bench_e2e_says_in_one_line_when_trl_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "lossreduce.bench.frameworks.trl", None)
    assert run_trl_e2e() is None
    assert capsys.readouterr().out.startswith("  TRL step: skipped (")


def test_bench_e2e_reports_the_trl_step_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # run_trl_bench itself is measured in the integration tests; here only its report.
    from lossreduce.bench.frameworks import trl as trl_bench

    measured = trl_bench.TRLBenchResult(
        lossreduce_step_s=0.104, dapo_step_s=0.100, lossreduce_steps=20, dapo_steps=20
    )
    monkeypatch.setattr(trl_bench, "run_trl_bench", lambda: measured)
    report = run_trl_e2e()
    assert report is not None
    assert report["ratio"] == pytest.approx(1.04)
    assert report["met"] is False
    assert "ratio 1.040, target <= 1.03 NOT met" in capsys.readouterr().out
    assert TRL_TARGET_RATIO == 1.03
