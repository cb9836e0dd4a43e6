"""What lossreduce's normalizers cost inside a TRL GRPO step.

Times optimizer steps of :class:`LossReduceGRPOTrainer` against the same
steps of TRL's ``GRPOTrainer`` with ``loss_type='dapo'`` (TRL's own token
normalization, the nearest like-for-like), on one process and a small Qwen2
model built in code, with fixed completions from a ``rollout_func`` (no
sampling, no hub access: the measured step is the training work alone, where
a fixed overhead shows most). Runs alternate ABBA so drift (thermal, other
load) hits both sides alike; the first step of each run is dropped as
warm-up and the medians are compared.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lossreduce.bench.frameworks.abba import ABBA, EOS, save_qwen2
from lossreduce.trainer_worker.integrations.settings import GRPOReductionSettings

# At import, as the integration's package checks TRL's version: without TRL (or with an
# untested one) importing this bench fails at once, and ``--e2e`` says so in one line.
from lossreduce.trainer_worker.integrations.trl import LossReduceGRPOTrainer
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = ["TRLBenchResult", "TRLBenchSettings", "run_trl_bench"]


class TRLBenchSettings(BaseModel):
    """The workload of :func:`run_trl_bench`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(
        default=12, ge=2, description="Optimizer steps per run (the first is warm-up)."
    )
    blocks: int = Field(
        default=2, ge=1, description="ABBA blocks; each block runs each trainer twice."
    )
    prompts: int = Field(default=8, ge=1, description="Prompts per optimizer step.")
    num_generations: int = Field(default=4, ge=2, description="Completions per prompt.")
    max_completion_length: int = Field(
        default=48, ge=2, description="Longest completion, in tokens; lengths are drawn below it."
    )
    gradient_accumulation_steps: int = Field(
        default=4, ge=1, description="Micro-steps per optimizer step."
    )
    hidden_size: int = Field(default=128, ge=8, description="Width of the Qwen2 model.")
    layers: int = Field(default=2, ge=1, description="Transformer layers of the Qwen2 model.")
    vocab_size: int = Field(default=64, ge=8, description="Vocabulary size of the toy tokenizer.")
    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description="lossreduce mode of the measured trainer (token_mean is dapo's meaning).",
    )
    beta: float = Field(default=0.0, ge=0, description="KL coefficient of both trainers.")
    seed: int = Field(default=0, description="Seed of the model weights and the completions.")


@dataclass(frozen=True)
class TRLBenchResult:
    """Median seconds per optimizer step of each trainer, and their ratio."""

    lossreduce_step_s: float
    dapo_step_s: float
    lossreduce_steps: int
    dapo_steps: int

    @property
    def ratio(self) -> float:
        """lossreduce / dapo median step time (1.03 = 3% slower)."""
        return self.lossreduce_step_s / self.dapo_step_s


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", *(f"w{i}" for i in range(vocab_size - 2))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


class _FixedRollout:
    """Completions drawn once per (prompt, generation): uneven lengths, fixed thereafter."""

    def __init__(self, settings: TRLBenchSettings) -> None:
        rng = random.Random(settings.seed)
        self.prompt_len = 4
        self.table = {
            (p, g): [
                *(rng.randrange(2, settings.vocab_size) for _ in range(n - 1)),
                EOS,
            ]
            for p in range(settings.prompts)
            for g in range(settings.num_generations)
            for n in [rng.randrange(2, settings.max_completion_length + 1)]
        }
        self.num_generations = settings.num_generations

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        first = trainer.accelerator.process_index * len(prompts)
        ids = [[2 + int(w[1:]) for w in p.split()] for p in prompts]
        return {
            "prompt_ids": ids,
            "completion_ids": [
                self.table[int(p.split()[0][1:]), (first + i) % self.num_generations]
                for i, p in enumerate(prompts)
            ],
            "logprobs": None,
        }


def _reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [float(sum(c) % 11) for c in completion_ids]


def _build(settings: TRLBenchSettings, workdir: Path, lossreduce: bool) -> tuple[Any, list[float]]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    name = "lossreduce" if lossreduce else "dapo"
    prompts = [f"w{p} w{p} w{p} w{p}" for p in range(settings.prompts)]
    args = GRPOConfig(
        output_dir=str(workdir / name),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=settings.prompts
        * settings.num_generations
        // settings.gradient_accumulation_steps,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        max_steps=settings.steps,
        learning_rate=1e-4,
        beta=settings.beta,
        loss_type="dapo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=settings.seed,
    )
    common: dict[str, Any] = {
        "args": args,
        "train_dataset": Dataset.from_dict({"prompt": prompts}),
        "processing_class": _tokenizer(settings.vocab_size),
        "rollout_func": _FixedRollout(settings),
    }
    model = str(workdir / "model")
    trainer = (
        LossReduceGRPOTrainer(
            model,
            _reward,
            reduction=GRPOReductionSettings(mode=settings.mode, job="trl-bench"),
            **common,
        )
        if lossreduce
        else GRPOTrainer(model, _reward, **common)
    )
    seconds: list[float] = []

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        started = 0.0
        in_run = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.in_run = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.in_run += 1
            if self.in_run > 1:  # the first step of a run builds the dataloader
                seconds.append(time.perf_counter() - self.started)

    trainer.add_callback(StepTimer())
    return trainer, seconds


def run_trl_bench(
    settings: TRLBenchSettings | None = None, workdir: Path | None = None
) -> TRLBenchResult:
    """Median optimizer-step time of LossReduceGRPOTrainer vs TRL's dapo, ABBA order."""
    settings = settings or TRLBenchSettings()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with tempfile.TemporaryDirectory(prefix="lossreduce-trl-bench-") as scratch:
        root = workdir or Path(scratch)
        save_qwen2(
            root / "model",
            settings,
            max_positions=settings.max_completion_length + 16,
            seed=settings.seed,
        )
        ours, our_seconds = _build(settings, root, lossreduce=True)
        theirs, their_seconds = _build(settings, root, lossreduce=False)
        for _ in range(settings.blocks):
            for lossreduce in ABBA:
                (ours if lossreduce else theirs).train()
        ours.close()
    return TRLBenchResult(
        lossreduce_step_s=statistics.median(our_seconds),
        dapo_step_s=statistics.median(their_seconds),
        lossreduce_steps=len(our_seconds),
        dapo_steps=len(their_seconds),
    )
