"""What lossreduce's normalizers cost inside a verl actor update.

Times PPO mini-batch steps (``train_mini_batch``: one optimizer step each) of
:class:`~lossreduce.trainer_worker.integrations.verl.LossReduceTrainingWorker`
against the same steps of verl's own ``TrainingWorker`` with ``token-mean``
(the like-for-like mode), both on verl's FSDP2 engine or both on its Megatron engine
(:attr:`VerlBenchSettings.strategy`), in one process, with a small Qwen2 built in
code and a fixed batch of uneven response lengths. After one warm-up step each, steps
alternate ABBA one by one, so drift and load hit both sides alike, and the medians are
compared.

Without CUDA it runs verl on lossreduce's CPU platform for verl
(:mod:`lossreduce.trainer_worker.cpu_standins.verl.platform`), selected with
:data:`~lossreduce.trainer_worker.cpu_standins.verl.env.CPU_ENV` before verl is first
imported (:func:`run_verl_bench` does that when verl is not imported yet), and the
Megatron engine on the CPU stand-ins of
:mod:`lossreduce.trainer_worker.cpu_standins.verl.megatron` (packed rows, the model
built through mbridge, bfloat16 parameters as verl's Megatron engine has them).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lossreduce.bench.frameworks.abba import PAD, save_qwen2, time_abba
from lossreduce.trainer_worker.cpu_standins.verl.env import CPU_ENV
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = ["VerlBenchResult", "VerlBenchSettings", "run_verl_bench"]


class VerlBenchSettings(BaseModel):
    """The workload of :func:`run_verl_bench`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rounds: int = Field(
        default=32,
        ge=1,
        description="ABBA rounds after the warm-up; each runs each worker's mini-batch step twice.",
    )
    responses: int = Field(
        default=32, ge=2, description="Responses per timed step (the batch verl's trainer sends)."
    )
    mini_batches: int = Field(
        default=1,
        ge=1,
        description="PPO mini-batches (optimizer steps) the step's responses are split into, "
        "each of responses / mini_batches responses.",
    )
    old_log_probs_current: bool = Field(
        default=False,
        description="Mark the batch as the lossreduce trainer mode marks one whose "
        "old_log_prob the actor recomputed for this update: with statistics='mini_batch', "
        "lossreduce's first mini-batch then takes its statistic from old_log_prob instead "
        "of a no-grad forward (the bench's old log-probabilities are made up; the time does "
        "not depend on their values).",
    )
    group_size: int = Field(default=4, ge=1, description="Responses per prompt group.")
    micro_batch_size: int = Field(default=8, ge=1, description="Micro-batch size (responses).")
    prompt_length: int = Field(default=8, ge=1, description="Tokens per prompt.")
    max_response_length: int = Field(
        default=48, ge=2, description="Longest response, in tokens; lengths are drawn below it."
    )
    hidden_size: int = Field(default=128, ge=8, description="Width of the Qwen2 model.")
    layers: int = Field(default=2, ge=1, description="Transformer layers of the Qwen2 model.")
    vocab_size: int = Field(default=64, ge=8, description="Vocabulary size.")
    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description="lossreduce mode of the measured worker (token_mean is token-mean's meaning).",
    )
    loss_mode: str = Field(
        default="vanilla",
        description="verl's actor.policy_loss.loss_mode, the same on both sides: 'kl_cov' or "
        "'clip_cov' times lossreduce's statistics over the whole mini-batch (a no-grad "
        "forward and the statistics' rounds) against verl's own per micro-batch.",
    )
    statistics: Literal["mini_batch", "per_call"] = Field(
        default="mini_batch",
        description="lossreduce's statistics scope for such a loss (VerlReductionSettings).",
    )
    seed: int = Field(default=0, description="Seed of the model weights and the batch.")
    strategy: Literal["fsdp2", "megatron"] = Field(
        default="fsdp2",
        description="verl's engine of both workers: 'fsdp2', or 'megatron' (needs "
        "megatron-core and mbridge, verl's mcore extra).",
    )

    @model_validator(mode="after")
    def _mini_batches_divide(self) -> VerlBenchSettings:
        per = self.responses // self.mini_batches
        if self.responses % self.mini_batches or per % self.micro_batch_size:
            raise ValueError(
                f"responses={self.responses} must split into mini_batches={self.mini_batches} "
                f"of a multiple of micro_batch_size={self.micro_batch_size} responses each"
            )
        return self


@dataclass(frozen=True)
class VerlBenchResult:
    """Median seconds per mini-batch step of each worker, and their ratio."""

    lossreduce_step_s: float
    verl_step_s: float
    lossreduce_steps: int
    verl_steps: int

    @property
    def ratio(self) -> float:
        """lossreduce / verl median step time (1.03 = 3% slower)."""
        return self.lossreduce_step_s / self.verl_step_s


def _batch(settings: VerlBenchSettings) -> Any:
    """One step's batch in the layout verl's trainer hands ``update_actor``."""
    import torch
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    rng = random.Random(settings.seed)
    n, p, r = settings.responses, settings.prompt_length, settings.max_response_length
    ids = torch.full((n, p + r), PAD, dtype=torch.long)
    attention = torch.zeros((n, p + r), dtype=torch.long)
    for i in range(n):
        length = rng.randrange(2, r + 1)
        ids[i, :p] = torch.randint(2, settings.vocab_size, (p,))
        ids[i, p : p + length] = torch.randint(2, settings.vocab_size, (length,))
        attention[i, : p + length] = 1
    response_mask = attention[:, p:].clone()
    gen = torch.Generator().manual_seed(settings.seed)
    old = -3.0 - torch.rand((n, r), generator=gen)
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :p],
            "responses": ids[:, p:],
            "response_mask": response_mask,
            "advantages": torch.randn((n, 1), generator=gen).expand(n, r).clone(),
            "old_log_probs": old,
            "uid": NonTensorStack(*(f"g{i // settings.group_size}" for i in range(n))),
        },
        batch_size=[n],
    )
    td = left_right_2_no_padding(td)
    if settings.old_log_probs_current:
        from lossreduce.trainer_worker.integrations.verl.worker import OLD_LOG_PROBS_CURRENT_KEY

        tu.assign_non_tensor(td, **{OLD_LOG_PROBS_CURRENT_KEY: True})
    per = n // settings.mini_batches
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        global_batch_size=per,
        mini_batch_size=per,
        epochs=1,
        seed=settings.seed,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
        temperature=1.0,
    )
    return td


def _engine(settings: VerlBenchSettings, model_dir: Path) -> dict[str, Any]:
    """The model, engine and optimizer configs of :attr:`VerlBenchSettings.strategy`."""
    from verl.workers.config import HFModelConfig

    if settings.strategy == "megatron":
        from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

        return {
            "model_config": HFModelConfig(path=str(model_dir), use_remove_padding=True),
            "engine_config": McoreEngineConfig(
                vanilla_mbridge=True,  # Megatron-Bridge imports Transformer Engine (CUDA)
                use_dynamic_bsz=False,
                micro_batch_size_per_gpu=settings.micro_batch_size,
            ),
            "optimizer_config": McoreOptimizerConfig(
                lr=1e-4, total_training_steps=10**6, lr_decay_style="constant"
            ),
        }
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

    return {
        "model_config": HFModelConfig(
            path=str(model_dir),
            use_remove_padding=False,
            override_config={"attn_implementation": "eager"},
        ),
        "engine_config": FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=False,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=settings.micro_batch_size,
        ),
        "optimizer_config": FSDPOptimizerConfig(lr=1e-4),
    }


def _worker(settings: VerlBenchSettings, model_dir: Path, lossreduce: bool) -> Any:
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import ActorConfig, PolicyLossConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from lossreduce.trainer_worker.integrations.verl.worker import LossReduceTrainingWorker

    config = TrainingWorkerConfig(
        model_type="language_model",
        **_engine(settings, model_dir),
        checkpoint_config=CheckpointConfig(),
    )
    actor = ActorConfig(
        strategy=settings.strategy,
        ppo_mini_batch_size=settings.responses // settings.mini_batches,
        ppo_micro_batch_size_per_gpu=settings.micro_batch_size,
        rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=settings.loss_mode),
    )
    reduction = VerlReductionSettings(
        mode=settings.mode, statistics=settings.statistics, job="verl-bench"
    )
    worker = (
        LossReduceTrainingWorker(config, reduction=reduction)
        if lossreduce
        else TrainingWorker(config)
    )
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker


def _init_process_group() -> bool:
    """Start a one-process gloo group unless one runs; whether it started one."""
    import torch.distributed as dist

    from lossreduce.ports import LOOPBACK, free_port

    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", LOOPBACK)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    return True


def run_verl_bench(settings: VerlBenchSettings | None = None) -> VerlBenchResult:
    """Median mini-batch step time of LossReduceTrainingWorker vs verl's token-mean, ABBA."""
    import sys

    import torch

    settings = settings or VerlBenchSettings()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available() and "verl" not in sys.modules:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    if settings.strategy == "megatron" and not torch.cuda.is_available():
        # verl's Megatron engine on the CPU stand-ins (installed on import).
        import lossreduce.trainer_worker.cpu_standins.verl.megatron  # noqa: F401
    owned = _init_process_group()
    try:
        with tempfile.TemporaryDirectory(prefix="lossreduce-verl-bench-") as scratch:
            model_dir = save_qwen2(
                Path(scratch) / "model",
                settings,
                max_positions=settings.prompt_length + settings.max_response_length + 8,
                seed=settings.seed,
            )
            workers = {ours: _worker(settings, model_dir, ours) for ours in (True, False)}
            batch = _batch(settings)
            # ABBA step by step: both workers see the same load, caches and drift.
            times = time_abba(
                lambda ours: workers[ours].train_mini_batch(batch.clone()), settings.rounds
            )
    finally:
        if settings.strategy == "megatron":
            from megatron.core import parallel_state as mpu

            mpu.destroy_model_parallel()
        if owned:
            torch.distributed.destroy_process_group()
    return VerlBenchResult(
        lossreduce_step_s=statistics.median(times[True]),
        verl_step_s=statistics.median(times[False]),
        lossreduce_steps=len(times[True]),
        verl_steps=len(times[False]),
    )
