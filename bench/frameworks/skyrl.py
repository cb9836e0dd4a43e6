"""What lossreduce's normalizers cost inside a SkyRL policy update.

Times policy mini-batch updates (``forward_backward`` then ``optim_step``: one optimizer
step each) of :class:`~lossreduce.trainer_worker.integrations.skyrl.LossReducePolicyWorker`
against the same updates of SkyRL's own ``FSDPPolicyWorkerBase`` with ``token_mean``
(the like-for-like mode), whose update includes what SkyRL's driver does for it: the
advantages divided by the mini-batch's token count
(``apply_loss_reduction_to_advantages_minibatch``). lossreduce's update includes what its
trainer adds on the driver (each row's prompt group). Both run SkyRL's FSDP strategy with
SkyRL's defaults (AdamW, the KL loss on, the entropy loss off) in one process, on a small
Qwen2 built in code and a fixed mini-batch of uneven response lengths. After one warm-up
update each, updates alternate ABBA one by one, so drift and load hit both sides alike,
and the medians are compared.

Without CUDA it runs SkyRL on lossreduce's CPU platform for SkyRL
(:mod:`lossreduce.trainer_worker.cpu_standins.skyrl.platform`), installed before SkyRL is
first imported.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lossreduce.bench.frameworks.abba import PAD, save_qwen2, time_abba
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = ["SkyRLBenchResult", "SkyRLBenchSettings", "run_skyrl_bench"]


class SkyRLBenchSettings(BaseModel):
    """The workload of :func:`run_skyrl_bench`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rounds: int = Field(
        default=32,
        ge=1,
        description="ABBA rounds after the warm-up; each runs each worker's update twice.",
    )
    responses: int = Field(default=32, ge=2, description="Responses per mini-batch.")
    group_size: int = Field(default=4, ge=1, description="Responses per prompt group.")
    micro_batch_size: int = Field(default=8, ge=1, description="Micro-batch size (responses).")
    prompt_length: int = Field(default=8, ge=1, description="Tokens per prompt.")
    max_response_length: int = Field(
        default=48, ge=2, description="Longest response, in tokens; lengths are drawn below it."
    )
    hidden_size: int = Field(default=128, ge=8, description="Width of the Qwen2 model.")
    layers: int = Field(default=2, ge=1, description="Transformer layers of the Qwen2 model.")
    vocab_size: int = Field(default=128, ge=8, description="Vocabulary size.")
    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description="lossreduce mode of the measured worker (token_mean is SkyRL's "
        "token_mean's meaning).",
    )
    seed: int = Field(default=0, description="Seed of the model weights and the batch.")


@dataclass(frozen=True)
class SkyRLBenchResult:
    """Median seconds per policy update of each worker, and their ratio."""

    lossreduce_step_s: float
    skyrl_step_s: float
    lossreduce_steps: int
    skyrl_steps: int

    @property
    def ratio(self) -> float:
        """lossreduce / SkyRL median update time (1.03 = 3% slower)."""
        return self.lossreduce_step_s / self.skyrl_step_s


@dataclass(frozen=True)
class _Batch:
    data: Any  # TrainingInputBatch, advantages not yet divided
    prompt_boundaries: list[tuple[int, int]]


def _batch(settings: SkyRLBenchSettings) -> _Batch:
    """One mini-batch in SkyRL's layout (left-padded sequences, right-aligned responses)."""
    import torch
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    rng = random.Random(settings.seed)
    n, p, r = settings.responses, settings.prompt_length, settings.max_response_length
    lengths = [rng.randrange(2, r + 1) for _ in range(n)]
    sequences = torch.full((n, p + r), PAD, dtype=torch.long)
    attention = torch.zeros((n, p + r), dtype=torch.long)
    response_mask = torch.zeros((n, r), dtype=torch.long)
    for i, length in enumerate(lengths):
        start = r - length  # left padding, then the prompt, then the response
        sequences[i, start : start + p + length] = torch.randint(
            2, settings.vocab_size, (p + length,)
        )
        attention[i, start:] = 1
        response_mask[i, r - length :] = 1
    gen = torch.Generator().manual_seed(settings.seed)
    old = -3.0 - torch.rand((n, r), generator=gen)
    data = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention,
            "response_mask": response_mask,
            "loss_mask": response_mask.clone(),
            "advantages": torch.randn((n, 1), generator=gen).expand(n, r) * response_mask,
            "action_log_probs": old,
            "base_action_log_probs": old + 0.1 * torch.randn((n, r), generator=gen),
        }
    )
    data.metadata = {"response_length": r}
    size = settings.group_size
    return _Batch(data, [(g, min(g + size, n)) for g in range(0, n, size)])


def _worker(settings: SkyRLBenchSettings, model_dir: Path, lossreduce: bool) -> Any:
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
    from skyrl.train.config.config import MixedPrecisionConfig

    from lossreduce.ports import LOOPBACK, free_port
    from lossreduce.trainer_worker.integrations.skyrl.config import LossReduceTrainerConfig
    from lossreduce.trainer_worker.integrations.skyrl.worker import LossReducePolicyWorker

    cfg = LossReduceTrainerConfig()
    cfg.policy.model.path = str(model_dir)
    cfg.flash_attn = False
    cfg.remove_microbatch_padding = False
    cfg.gradient_checkpointing = False
    cfg.micro_train_batch_size_per_gpu = settings.micro_batch_size
    cfg.policy.fsdp_config.mixed_precision = MixedPrecisionConfig(param_dtype="fp32")
    cfg.policy.optimizer_config.lr = 1e-4
    cfg.algorithm.temperature = 1.0
    if lossreduce:
        cfg.lossreduce = {"mode": settings.mode.value, "job": "skyrl-bench", "run": "bench"}
    cls = LossReducePolicyWorker if lossreduce else FSDPPolicyWorkerBase
    worker = cls(
        cfg=cfg,
        world_size=1,
        rank=0,
        local_rank=0,
        master_addr=LOOPBACK,
        master_port=int(os.environ.get("MASTER_PORT") or free_port()),
        sequence_parallel_size=1,
    )
    worker.init_worker_process_group()
    worker.init_model(str(model_dir))
    return worker


def _stock_update(worker: Any, batch: _Batch) -> None:
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        apply_loss_reduction_to_advantages_minibatch,
    )

    data = batch.data
    divided = data.select(list(data.keys()))
    divided["advantages"] = apply_loss_reduction_to_advantages_minibatch(
        advantages=data["advantages"],
        loss_mask=data["loss_mask"],
        loss_reduction="token_mean",
        micro_batch_size=worker.cfg.micro_train_batch_size_per_gpu,
        max_seq_len=data.metadata["response_length"],
    )
    worker.forward_backward(divided)
    worker.optim_step()


def _lossreduce_update(worker: Any, batch: _Batch) -> None:
    from lossreduce.trainer_worker.integrations.skyrl.plan import PROMPT_FIELD, prompt_ids

    data = batch.data.select(list(batch.data.keys()))
    data[PROMPT_FIELD] = prompt_ids(batch.prompt_boundaries, len(data))
    worker.forward_backward(data)
    worker.optim_step()


def run_skyrl_bench(settings: SkyRLBenchSettings | None = None) -> SkyRLBenchResult:
    """Median policy update time of LossReducePolicyWorker vs SkyRL's token_mean, ABBA."""
    import torch

    settings = settings or SkyRLBenchSettings()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available():
        from lossreduce.trainer_worker.cpu_standins.skyrl.platform import install

        install()
    update = {True: _lossreduce_update, False: _stock_update}
    try:
        with tempfile.TemporaryDirectory(prefix="lossreduce-skyrl-bench-") as scratch:
            model_dir = save_qwen2(
                Path(scratch) / "model",
                settings,
                max_positions=settings.prompt_length + settings.max_response_length + 8,
                seed=settings.seed,
                bos_token_id=None,  # no BOS, as this bench has always built it
            )
            workers = {ours: _worker(settings, model_dir, ours) for ours in (True, False)}
            batch = _batch(settings)
            # ABBA update by update: both workers see the same load, caches and drift.
            times = time_abba(lambda ours: update[ours](workers[ours], batch), settings.rounds)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return SkyRLBenchResult(
        lossreduce_step_s=statistics.median(times[True]),
        skyrl_step_s=statistics.median(times[False]),
        lossreduce_steps=len(times[True]),
        skyrl_steps=len(times[False]),
    )
