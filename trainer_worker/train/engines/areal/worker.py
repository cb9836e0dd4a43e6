"""One rank of ``lossreduce train --engine areal``: AReaL's FSDP actor in a Ray actor.

Each worker joins torch.distributed (gloo on CPU, nccl on a GPU) and builds
:class:`~lossreduce.trainer_worker.integrations.areal.LossReduceFSDPPPOActor`,
AReaL's ``FSDPPPOActor`` whose PPO update takes lossreduce's normalizers
(torch.distributed over its data-parallel group, or the coordinator). Per step:

1. :meth:`ArealWorker.sample`: responses for its slice of the step's prompts
   from the actor's own (sharded) policy, through the job's sampler
   (:func:`~lossreduce.trainer_worker.train.rollouts.sample_responses`);
   every rank samples at once, because each forward all-gathers the FSDP
   shards;
2. :meth:`ArealWorker.train`: on its shard of whole prompt groups, AReaL's own
   path: ``compute_logp`` (the proximal log-probabilities), ``compute_advantages``
   (the group-relative rewards placed on each response, the KL-in-reward
   penalty) and ``ppo_update`` (one ``train_batch``: one optimizer step).

The class is plain Python; the engine wraps it with ``ray.remote``.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# Imported first for what it does: AReaL's modules log and warn as they are imported.
import lossreduce.trainer_worker.train.engines.areal.quiet  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from areal.api.io_struct import FinetuneSpec
from areal.utils import stats_tracker
from pydantic import Field
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn import functional
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.integrations.areal import (
    ArealReductionSettings,
    LossReduceFSDPPPOActor,
)
from lossreduce.trainer_worker.integrations.areal.plan import GROUP_KEY, plan_batch
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction
from lossreduce.trainer_worker.train.engines.areal.model import (
    actor_config,
    eager_on_cpu,
    save_policy,
    use_per_sequence_attention,
)
from lossreduce.trainer_worker.train.engines.areal.task import (
    Trajectory,
    placeholder_group,
    trajectories,
)
from lossreduce.trainer_worker.train.engines.base import REDUCTION_GROUP
from lossreduce.trainer_worker.train.engines.rank import RankActor, RankConfig, sample_slice
from lossreduce.trainer_worker.train.hf_policy import TaskLogits
from lossreduce.trainer_worker.train.rollouts import RolloutBatch, Samples
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["ArealStepResult", "ArealWorker", "ArealWorkerConfig", "reduction_settings"]

_STATS = "ppo_actor/update/"
"""Scope of what AReaL's ``ppo_update`` records of its ``train_batch``."""


class ArealWorkerConfig(RankConfig):
    """What one rank needs to start: the shared fields and the policy's folder."""

    model_path: Path = Field(description="The policy's checkpoint folder (weights, tokenizer).")


@dataclass(frozen=True)
class ArealStepResult:
    """What a rank reports after a step."""

    rank: int
    skipped: bool
    loss_share: float
    """This rank's share of the step's global policy loss (the ranks' shares add up to it)."""
    normalizers: dict[str, float]
    """The step's global normalizers (empty when skipped)."""
    round_seconds: float
    """This rank's normalizer round (blocking: the rank waited all of it)."""
    step_seconds: float


def reduction_settings(
    settings: TrainSettings,
    job: str,
    *,
    coordinator: str | None,
    client: ClientSettings,
) -> ArealReductionSettings:
    """The actor's reduction: the run's mode, divisor, backend and empty-step rule."""
    return ArealReductionSettings(
        mode=PolicyGradientMode(settings.mode),
        divisor=settings.effective_divisor,
        normalizer="coordinator" if coordinator is not None else "torch",
        coordinator=coordinator,
        client=client,
        on_empty_step=settings.on_empty_step,
        job=job,
        group=REDUCTION_GROUP,
        run=settings.run,
    )


class _TimedActor(LossReduceFSDPPPOActor):
    """The LossReduce FSDP actor, timing its (blocking) normalizer round."""

    round_seconds = 0.0

    def _reduce(self, step: int, plan: Any, device: torch.device) -> dict[str, float] | None:
        start = time.perf_counter()
        try:
            return super()._reduce(step, plan, device)
        finally:
            self.round_seconds = time.perf_counter() - start


class _FullLogits(nn.Module):
    """A causal LM as ``[N, T]`` ids -> ``[N, T, V]`` logits over its whole vocabulary,
    the one AReaL's log-probabilities normalize over."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.model(input_ids=tokens).logits
        return logits


class ArealWorker(RankActor):
    """One rank: AReaL's FSDP PPO actor with lossreduce's reduction, and the job's sampler."""

    def __init__(self, config: ArealWorkerConfig) -> None:
        self.config = config
        self.settings = config.settings
        self.rank = config.rank
        self.cuda = torch.cuda.is_available()
        # Ray shows each GPU actor only its own GPU: device 0 of the process.
        self.device = torch.device("cuda:0" if self.cuda else "cpu")
        if not self.cuda:
            # One bundle = one CPU: more threads only fight the other ranks.
            torch.set_num_threads(1)
        eager_on_cpu()
        use_per_sequence_attention()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        self._actor: _TimedActor | None = None
        self._reference: nn.Module | None = None
        self._capture = False
        self._gradients: dict[str, Tensor] | None = None

    # -- setup -------------------------------------------------------------------

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the process group, build and load the actor (and the KL reference)."""
        settings, config = self.settings, self.config
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(config.world_size),
            # Ray shows each GPU actor only its own GPU: device 0 of the process.
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
        dist.init_process_group(
            "nccl" if self.cuda else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=settings.round_timeout_s + 30),
        )
        reduction = reduction_settings(
            settings,
            config.job,
            coordinator=config.coordinator,
            client=ClientSettings(
                call_timeout_s=settings.round_timeout_s + 30,
                token=config.coordinator_token,
                tls_root_cert_pem=config.coordinator_tls_ca,
            ),
        )
        model_path = self._model_path()
        actor = _TimedActor(
            actor_config(
                settings,
                model_path,
                config.world_size,
                trial=f"{config.job}-rank{self.rank}",
                verify=settings.verify,
            ),
            reduction=reduction,
        )
        actor.create_process_group()
        actor.initialize(
            None,
            FinetuneSpec(
                total_train_epochs=1,
                dataset_size=settings.steps * settings.prompts_per_step,
                train_batch_size=settings.prompts_per_step,
            ),
        )
        actor.optimizer.register_step_pre_hook(self._capture_gradients)
        self._actor = actor
        if settings.kl_coef > 0:
            reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            reference = reference.to(actor.device).eval().requires_grad_(False)
            self._reference = _FullLogits(reference)

    # -- per step ----------------------------------------------------------------

    def sample(self, step: int, prompt_tokens: Tensor, first_prompt: int) -> Samples:
        """Responses for prompts ``first_prompt ...`` of ``step`` (every rank at once)."""
        actor = self._require_actor()
        actor.eval()
        return sample_slice(
            self.settings,
            TaskLogits(actor.model),
            self._reference,
            step=step,
            prompt_tokens=prompt_tokens,
            first_prompt=first_prompt,
            device=actor.device,
        )

    def train(self, step: int, shard: RolloutBatch, capture: bool = False) -> ArealStepResult:
        """One optimizer step on this rank's shard (or a skip, on every rank alike)."""
        actor = self._require_actor()
        start = time.perf_counter()
        with_reference = self._reference is not None
        groups = trajectories(shard, with_reference=with_reference)
        missing = self.settings.microbatches - len(shard)
        if missing > 0:
            width = int(shard.tokens.shape[1])
            groups.append(
                placeholder_group(shard.prompt_len, width, missing, with_reference=with_reference)
            )
        device = actor.device
        groups = [{k: v.to(device) for k, v in g.items()} for g in groups]
        stats_tracker.export(reset=True)  # what earlier calls recorded
        for group, logp in zip(groups, actor.compute_logp(groups), strict=True):
            # [n, t] with t the batch's longest attended sequence: padded back to [n, T].
            width = group["input_ids"].shape[1]
            group["prox_logp"] = functional.pad(logp, (0, width - logp.shape[-1]))
        groups = actor.compute_advantages(groups)
        numerators = _policy_numerators(self.settings, groups)
        self._capture = capture
        actor.ppo_update(groups)
        stats = stats_tracker.export(reset=True)
        skipped = bool(stats.get(f"{_STATS}lossreduce/skipped", 0.0))
        if not skipped and not stats.get(f"{_STATS}update_successful", 0.0):
            raise RuntimeError(
                f"job {self.config.job!r} step {step} rank {self.rank}: AReaL skipped the "
                f"optimizer step (grad_norm {stats.get(f'{_STATS}grad_norm')})"
            )
        normalizers = {} if skipped else {"pg": float(stats[f"{_STATS}lossreduce/normalizer/pg"])}
        # At the step's start the PPO ratio is 1, so each token's loss is -A.
        loss_share = 0.0 if skipped else -numerators / normalizers["pg"]
        return ArealStepResult(
            rank=self.rank,
            skipped=skipped,
            loss_share=loss_share,
            normalizers=normalizers,
            round_seconds=actor.round_seconds,
            step_seconds=time.perf_counter() - start,
        )

    def gradients(self) -> dict[str, Tensor]:
        """The whole gradient of the last ``train(capture=True)``, as the optimizer saw it."""
        if self._gradients is None:
            raise RuntimeError(f"rank {self.rank}: no gradients were captured")
        return self._gradients

    def shutdown(self) -> None:
        if self._actor is not None:
            self._actor.destroy()
            self._actor = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- internals ---------------------------------------------------------------

    def _model_path(self) -> Path:
        path = self.config.model_path
        if path.is_dir():
            return path
        # Another node without the driver's disk: the same seed builds the same policy.
        local = Path(tempfile.gettempdir()) / f"lossreduce-{self.config.job}-rank{self.rank}-model"
        return save_policy(self.settings, local)

    def _require_actor(self) -> _TimedActor:
        if self._actor is None:
            raise RuntimeError(f"rank {self.rank}: setup() was not called")
        return self._actor

    def _capture_gradients(self, *_: Any) -> None:
        """Optimizer pre-step hook: every rank gathers the full gradients (collective)."""
        if not self._capture:
            return
        self._capture = False
        grads = {}
        for name, param in self._require_actor().model.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            full = grad.full_tensor() if isinstance(grad, DTensor) else grad
            grads[name] = full.detach().cpu().clone()
        self._gradients = grads


def _policy_numerators(settings: TrainSettings, groups: list[Trajectory]) -> float:
    """``sum_i w_i sum_t A[i,t] m[i,t]`` of this rank's rows (``w_i`` of the run's mode).

    ``groups`` are after ``compute_advantages`` (the loss mask rolled onto the
    predicting positions); the prompt groups are numbered as the LossReduce
    actor numbers them.
    """
    mask = torch.cat([g["loss_mask"] for g in groups]).cpu()  # [B, T]
    advantages = torch.cat([g["advantages"] for g in groups]).cpu()  # [B, T]
    numbered = torch.cat(
        [torch.full(g["loss_mask"].shape, i, dtype=torch.int64) for i, g in enumerate(groups)]
    )  # [B, T]
    reduction = PolicyGradientReduction(
        PolicyGradientMode(settings.mode), settings.effective_divisor
    )
    plan = plan_batch(
        reduction, {"loss_mask": mask, GROUP_KEY: numbered}, float(mask.count_nonzero())
    )
    per_row = (advantages.double() * mask).sum(-1)  # [B]
    return math.fsum((plan.row_weights * per_row).tolist())
