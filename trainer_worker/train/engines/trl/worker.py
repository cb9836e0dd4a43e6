"""One TRL process of ``lossreduce train --engine trl``, run as a Ray actor.

Each actor of the worker group joins torch.distributed the way the torch
engine's workers do (gloo on CPU, nccl on GPU), but through the environment
variables accelerate reads (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), so accelerate's ``PartialState`` sees the
group as its own; then it runs :class:`LossReduceGRPOTrainer` on the text
digit task. Rank 0 reports every optimizer step to the driver through a Ray
queue (the progress bar and ``metrics.jsonl``).

:func:`build_trainer` is also the driver's one-process reference of ``--verify``.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets
import ray
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from torch import Tensor
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig

from lossreduce.client import ClientSettings
from lossreduce.ports import free_port
from lossreduce.trainer_worker.integrations import GRPOReductionSettings
from lossreduce.trainer_worker.integrations.trl import LossReduceGRPOTrainer
from lossreduce.trainer_worker.train.engines.trl.reduction import reduction_settings
from lossreduce.trainer_worker.train.engines.trl.task import (
    DigitReward,
    prompt_dataset,
    save_tiny_qwen2,
    task_of,
)
from lossreduce.trainer_worker.train.outputs import StepRecord
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = [
    "Rollout",
    "StepReporter",
    "TRLRunSummary",
    "TRLWorker",
    "TRLWorkerConfig",
    "build_trainer",
    "frameworks_quiet",
    "reduction_settings",
    "rows_per_device",
    "silence_frameworks",
]

Rollout = tuple[str, list[int]]
"""One completion as ``--verify`` replays it: (prompt text, completion token ids)."""


def rows_per_device(settings: TrainSettings, world_size: int) -> int:
    """Completions each process trains on per micro-step."""
    rows = settings.prompts_per_step * settings.samples_per_prompt
    # TrainSettings refuses --engine trl batches that do not split evenly.
    assert rows % (world_size * settings.microbatches) == 0, (rows, world_size)
    return rows // (world_size * settings.microbatches)


def grpo_config(
    settings: TrainSettings, out_dir: Path, world_size: int, *, steps: int, verify: bool
) -> GRPOConfig:
    """TRL's configuration of the run: one optimizer step = one generation batch =
    ``--prompts-per-step`` prompts x ``--samples-per-prompt`` completions over all processes."""
    # TRL turns checkpointing on by default, which the tiny model does not need;
    # transformers calls the switch activation_checkpointing from 5.2x on,
    # gradient_checkpointing before (trl[vllm]==1.16.0 resolves to transformers 5.17).
    fields = GRPOConfig.__dataclass_fields__
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    return GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        **{checkpointing: False},
        ddp_find_unused_parameters=False,
        per_device_train_batch_size=rows_per_device(settings, world_size),
        gradient_accumulation_steps=settings.microbatches,
        num_generations=settings.samples_per_prompt,
        max_completion_length=settings.response_len,
        max_steps=steps,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        # --verify compares raw gradients; clipping would hide a wrong scale.
        max_grad_norm=0.0 if verify else 1.0,
        beta=settings.kl_coef,
        epsilon=settings.clip_eps,
        temperature=settings.temperature,
        seed=settings.seed,
        loss_type="dapo",
    )


class _RecordingTrainer(LossReduceGRPOTrainer):
    """With ``record``, keeps the completions it trained on."""

    def __init__(
        self,
        model: str,
        reward: DigitReward,
        *,
        args: GRPOConfig,
        train_dataset: Any,
        processing_class: Any,
        rollout_func: Callable[..., dict[str, Any]] | None,
        reduction: GRPOReductionSettings,
        record: bool,
    ) -> None:
        super().__init__(
            model,
            reward,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            rollout_func=rollout_func,
            reduction=reduction,
        )
        self.record = record
        self.rollouts: list[Rollout] = []

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        if self.record:
            ids, mask = output["completion_ids"].cpu(), output["completion_mask"].cpu()  # [B, T]
            self.rollouts += [
                (row["prompt"], ids[i][mask[i].bool()].tolist()) for i, row in enumerate(inputs)
            ]
        return output


class _Replay:
    """A TRL ``rollout_func`` answering with recorded completions, in order."""

    def __init__(self, rollouts: list[Rollout], tokenizer: Any) -> None:
        self.rollouts = rollouts
        self.tokenizer = tokenizer
        self.used = 0

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        batch = self.rollouts[self.used : self.used + len(prompts)]
        self.used += len(prompts)
        got = [prompt for prompt, _ in batch]
        if got != prompts:
            raise RuntimeError(
                f"--verify: the one-process run drew prompts {prompts} where the workers "
                f"trained on {got}; the replay cannot pair them"
            )
        return {
            "prompt_ids": [self.tokenizer(p)["input_ids"] for p in prompts],
            "completion_ids": [ids for _, ids in batch],
            "logprobs": None,
        }


def build_trainer(
    settings: TrainSettings,
    model_path: Path,
    out_dir: Path,
    reduction: GRPOReductionSettings,
    *,
    world_size: int,
    steps: int,
    pad_with_eos: bool,
    replay: list[Rollout] | None = None,
) -> _RecordingTrainer:
    """The GRPO trainer of one process (``replay``: the one-process ``--verify`` run)."""
    # The one-process replay trains on the whole batch, in the same micro-steps.
    processes = world_size if replay is None else 1
    config = grpo_config(settings, out_dir, processes, steps=steps, verify=settings.verify)
    dataset = prompt_dataset(settings, settings.prompts_per_step * steps)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if pad_with_eos:
        tokenizer.pad_token = tokenizer.eos_token  # the driver checked it and said so
    rollout: Callable[..., dict[str, Any]] | None = (
        None if replay is None else _Replay(replay, tokenizer)
    )
    trainer = _RecordingTrainer(
        str(model_path),
        DigitReward(task_of(settings)),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
        reduction=reduction,
        record=settings.verify and replay is None,
    )
    # The driver shows progress; TRL's printer would dump every log dict to stdout.
    trainer.remove_callback(PrinterCallback)
    return trainer


def silence_frameworks() -> None:
    """No loading bars, info logs or TRL's deprecation noise: the driver shows progress."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # TRL 1.16 calls transformers' deprecated checkpointing alias on every model load.
    warnings.filterwarnings("ignore", r".*deprecated and will be removed in v6", FutureWarning)


@contextmanager
def frameworks_quiet() -> Iterator[None]:
    """:func:`silence_frameworks` for a block of the driver's own process, then as before."""
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    dataset_bars = datasets.is_progress_bar_enabled()
    with warnings.catch_warnings():
        silence_frameworks()
        try:
            yield
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
            if dataset_bars:
                datasets.enable_progress_bars()


class TRLWorkerConfig(BaseModel):
    """What one TRL rank needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    job: str = Field(description="Job name of the coordinator rounds and metrics.")
    rank: int = Field(ge=0, description="This worker's rank.")
    world_size: int = Field(ge=1, description="Number of ranks.")
    local_rank: int = Field(ge=0, description="This worker's index among the ranks of its node.")
    coordinator: str | None = Field(
        description="HOST:PORT this rank sends its partials to (None with the torch normalizer)."
    )
    coordinator_token: SecretStr | None = Field(
        description="Bearer token the coordinator accepts (None: send none)."
    )
    coordinator_tls_ca: bytes | None = Field(
        default=None, description="PEM CA of the coordinator's TLS certificate (None: plaintext)."
    )
    model_path: Path = Field(
        description="The policy checkpoint (--model, or the built-in model saved by the driver)."
    )
    pad_with_eos: bool = Field(
        default=False, description="The tokenizer has no pad token: pad with its EOS."
    )
    built_in: bool = Field(
        description="Whether the policy is the built-in tiny Qwen2, which a rank on another "
        "node rebuilds from the seed when the driver's copy is not on its disk."
    )
    out_dir: Path = Field(description="The run's output directory.")
    settings: TrainSettings = Field(description="The run's settings.")


@dataclass(frozen=True)
class TRLRunSummary:
    """What a rank reports at the end of its run."""

    rank: int
    skipped_steps: int
    loss: float | None
    """The last optimizer step's global loss (None when every step was skipped)."""
    gradients: dict[str, Tensor] | None
    """``--verify``: the step's gradients after the processes' average."""
    rollouts: list[Rollout] | None
    """``--verify``: this rank's completions of the step, in its row order."""


class StepReporter(TrainerCallback):  # type: ignore[misc]
    """Rank 0: a :class:`StepRecord` per optimizer step into the driver's queue;
    every rank: the gradients of the first step under ``--verify``."""

    def __init__(self, trainer: _RecordingTrainer, queue: Any, capture: bool) -> None:
        self.trainer = trainer
        self.queue = queue
        self.capture = capture
        self.gradients: dict[str, Tensor] | None = None
        self.loss: float | None = None
        self._started = 0.0
        self._seconds = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._started = time.perf_counter()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.capture and self.gradients is None:
            self.gradients = {
                name: p.grad.detach().cpu().clone()
                for name, p in self.trainer.model.named_parameters()
                if p.grad is not None
            }

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._seconds = time.perf_counter() - self._started

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any
    ) -> None:
        if not logs or "reward" not in logs:
            return  # the end-of-training summary
        skipped = bool(logs.get("lossreduce/skipped", 0.0))
        if not skipped and "loss" in logs:
            self.loss = float(logs["loss"])
        if self.queue is None or not state.is_world_process_zero:
            return
        prefix = "lossreduce/normalizer/"
        normalizers = {k[len(prefix) :]: float(v) for k, v in logs.items() if k.startswith(prefix)}
        responses = int(
            args.per_device_train_batch_size * args.world_size * args.steps_per_generation
        )
        # Rank 0's own round timing, as the trainer logged it for this step.
        self.queue.put(
            StepRecord(
                step=int(state.global_step) - 1,
                reward=float(logs["reward"]),
                losses={} if skipped else {"total": float(logs.get("loss", 0.0))},
                normalizers={} if skipped else normalizers,
                round_latency_s=float(logs.get("lossreduce/round_latency_s", 0.0)),
                normalizer_wait_s=float(logs.get("lossreduce/normalizer_wait_s", 0.0)),
                step_seconds=self._seconds,
                skipped=skipped,
                responses=responses,
                groups=responses // self.trainer.num_generations,
                tokens=round(float(logs.get("completions/mean_length", 0.0)) * responses),
            )
        )


class TRLWorker:
    """One rank: a TRL process in the Ray worker group. Plain Python; the job wraps it."""

    def __init__(self, config: TRLWorkerConfig) -> None:
        self.config = config
        self.settings = config.settings
        self.rank = config.rank
        if not torch.cuda.is_available():
            # One bundle = one CPU: more threads only fight the other ranks.
            torch.set_num_threads(1)
        silence_frameworks()

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 only: an address and free port on its node for torch.distributed."""
        return ray.util.get_node_ip_address(), free_port("0.0.0.0")

    def run(self, master_addr: str, master_port: int, queue: Any, steps: int) -> TRLRunSummary:
        """Train ``steps`` optimizer steps; rank 0 puts each step's record into ``queue``."""
        cuda = torch.cuda.is_available()
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.config.world_size),
            # Ray shows each GPU actor only its own GPU: device 0 of the process.
            LOCAL_RANK="0" if cuda else str(self.config.local_rank),
            LOCAL_WORLD_SIZE="1" if cuda else str(self.config.world_size),
        )
        reduction = reduction_settings(
            self.settings,
            self.config.job,
            normalizer=self.settings.normalizer,
            coordinator=self.config.coordinator,
            client=ClientSettings(
                call_timeout_s=self.settings.round_timeout_s + 30,
                token=self.config.coordinator_token,
                tls_root_cert_pem=self.config.coordinator_tls_ca,
            ),
        )
        trainer = build_trainer(
            self.settings,
            self._model_path(),
            self.config.out_dir / f"trl-rank{self.rank}",
            reduction,
            world_size=self.config.world_size,
            steps=steps,
            pad_with_eos=self.config.pad_with_eos,
        )
        reporter = StepReporter(trainer, queue, capture=self.settings.verify)
        trainer.add_callback(reporter)
        try:
            trainer.train()
        finally:
            trainer.close()
        return TRLRunSummary(
            rank=self.rank,
            skipped_steps=trainer.skipped_steps,
            loss=reporter.loss,
            gradients=reporter.gradients,
            rollouts=trainer.rollouts if self.settings.verify else None,
        )

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _model_path(self) -> Path:
        path = self.config.model_path
        if path.is_dir() or not self.config.built_in:
            return path
        # Another node without the driver's disk: the same seed builds the same model.
        local = Path(tempfile.gettempdir()) / f"lossreduce-{self.config.job}-rank{self.rank}-model"
        return save_tiny_qwen2(self.settings, local)
