"""``VerlWorker``: one rank of ``--engine verl``, run as a Ray actor.

Each worker holds verl's actor worker (:mod:`.actor`: verl's FSDP2 engine,
normalized by lossreduce) and, as verl's rollout engines do, a plain copy of the
policy to sample from, refreshed from the actor's weights after every optimizer
step (plus, with a KL term, the frozen initial policy as the reference). Per step:

1. :meth:`VerlWorker.sample` samples responses for its slice of the step's
   prompts with the job's sampler;
2. :meth:`VerlWorker.train` trains one PPO mini-batch (one optimizer step) on
   its shard of whole prompt groups through verl's ``train_mini_batch``: the
   integration counts the partials, fetches the validated global normalizers
   (coordinator or torch.distributed) and runs verl's micro-batches with them.

The process selects verl's platform before verl is imported (:mod:`.env`:
lossreduce's CPU platform when there is no CUDA) and joins torch.distributed
itself (gloo on CPU; gloo and nccl on CUDA, as verl does) before verl's worker starts, which then
finds the group initialized. The class is plain Python; the driver wraps it
with ``ray.remote``, and ``--verify`` runs it in the driver as a group of one.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.train.engines.base import REDUCTION_GROUP
from lossreduce.trainer_worker.train.engines.rank import RankActor, RankConfig, sample_slice
from lossreduce.trainer_worker.train.engines.verl.env import prepare_verl_process
from lossreduce.trainer_worker.train.engines.verl.model import FullVocabLogits
from lossreduce.trainer_worker.train.rollouts import RolloutBatch, Samples

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["VerlStepResult", "VerlWorker", "VerlWorkerConfig", "padded_rows"]


def padded_rows(shard_rows: Sequence[int], microbatches: int) -> int:
    """Rows every rank trains on: the longest shard, rounded up to whole micro-batches
    (verl's collectives need the same micro-batches on every rank; at least one row)."""
    per_micro = max(1, math.ceil(max(shard_rows, default=0) / microbatches))
    return per_micro * microbatches


class VerlWorkerConfig(RankConfig):
    """What one rank needs to start."""

    cpu_threads: int | None = Field(
        default=1,
        description="torch threads of this process on CPU (one bundle is one CPU: more only "
        "fight the other ranks); None leaves torch's default.",
    )
    model_path: Path = Field(
        description="The built-in policy's checkpoint folder, as the driver saved it; a rank "
        "on a node without it rebuilds it from the seed."
    )


@dataclass(frozen=True)
class VerlStepResult:
    """What a rank reports after a step; losses and normalizers are global."""

    rank: int
    skipped: bool
    losses: dict[str, float]
    """Each term's global loss (its coefficient applied); empty when skipped."""
    normalizers: dict[str, float]
    """Each term's global normalizer; empty when skipped."""
    round_latency_s: float
    """This rank's normalizer round, from its start to its answer."""
    step_seconds: float


def _full(tensor: Tensor) -> Tensor:
    """A parameter or gradient in full on CPU (FSDP2 shards them as DTensors)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu().clone()


class VerlWorker(RankActor):
    """One rank: verl's actor worker, the rollout copy of its policy, and the reference."""

    def __init__(self, config: VerlWorkerConfig) -> None:
        self.config = config
        self.settings = config.settings
        self.rank = config.rank
        self.cpu = prepare_verl_process()
        self.device = torch.device("cpu" if self.cpu else "cuda")
        if self.cpu and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        # A LossReduceTrainingWorker once set up (its class imports verl: not before).
        self._actor: Any = None
        self._rollout: FullVocabLogits | None = None
        self._reference: FullVocabLogits | None = None
        self.captured_gradients: dict[str, Tensor] | None = None

    # -- setup ---------------------------------------------------------------

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the process group, start verl's actor worker and load the rollout copies."""
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.config.world_size),
            # Ray shows each GPU actor only its own GPU: device 0 of the process.
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
        if not self.cpu:
            torch.cuda.set_device(0)
        dist.init_process_group(
            # verl's own choice on CUDA: gloo for its CPU collectives (object gathers), nccl
            # for tensors. lossreduce's CPU platform asks for gloo alone.
            "gloo" if self.cpu else "cpu:gloo,cuda:nccl",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.config.world_size,
            timeout=timedelta(seconds=self.settings.round_timeout_s + 30),
        )
        # verl is imported only now, after prepare_verl_process() chose its platform.
        from transformers import Qwen2ForCausalLM
        from transformers.utils import logging as hf_logging

        with warnings.catch_warnings():
            # verl names every optional engine it cannot load (Megatron, VeOmni, ...).
            warnings.filterwarnings(
                "ignore", message=r"\w+ engine is not available", category=UserWarning
            )
            from lossreduce.trainer_worker.train.engines.verl.actor import build_actor
        hf_logging.disable_progress_bar()  # the run prints its own progress

        model_dir = self._model_path()
        self._actor = build_actor(self.settings, model_dir, self._reduction())
        policy = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        self._rollout = FullVocabLogits(policy.float().to(self.device)).eval().requires_grad_(False)
        if self.settings.kl_coef > 0:
            self._reference = copy.deepcopy(self._rollout)

    def _reduction(self) -> VerlReductionSettings:
        settings = self.settings
        return VerlReductionSettings(
            mode=PolicyGradientMode(settings.mode),
            divisor=settings.effective_divisor,
            normalizer=settings.normalizer,
            coordinator=self.config.coordinator,
            client=ClientSettings(
                call_timeout_s=settings.round_timeout_s + 30,
                token=self.config.coordinator_token,
                tls_root_cert_pem=self.config.coordinator_tls_ca,
            ),
            on_empty_step=settings.on_empty_step,
            job=self.config.job,
            group=REDUCTION_GROUP,
            run=settings.run,
        )

    def _model_path(self) -> Path:
        path = self.config.model_path
        if path.is_dir():
            return path
        # Another node without the driver's disk: the same seed builds the same model.
        from lossreduce.trainer_worker.train.hf_policy import save_task_qwen2

        local = Path(tempfile.gettempdir()) / f"lossreduce-{self.config.job}-rank{self.rank}-model"
        return save_task_qwen2(self.settings, local)

    # -- per step ------------------------------------------------------------

    def sample(self, step: int, prompt_tokens: Tensor, first_prompt: int) -> Samples:
        """Responses for prompts ``first_prompt ...`` of ``step``, on CPU."""
        if self._rollout is None:
            raise RuntimeError(f"rank {self.rank}: setup() was not called")
        return sample_slice(
            self.settings,
            self._rollout,
            self._reference,
            step=step,
            prompt_tokens=prompt_tokens,
            first_prompt=first_prompt,
            device=self.device,
        )

    def train(
        self,
        step: int,
        shard: RolloutBatch,
        group_ids: Sequence[int],
        rows: int,
        capture_gradients: bool = False,
    ) -> VerlStepResult:
        """One optimizer step on this rank's shard padded to ``rows`` rows (or a skip,
        on every rank alike), then the rollout copy takes the new weights."""
        from lossreduce.trainer_worker.train.engines.verl.batch import mini_batch

        actor = self._actor
        if actor is None:
            raise RuntimeError(f"rank {self.rank}: setup() was not called")
        start = time.perf_counter()
        data = mini_batch(
            shard,
            group_ids,
            rows=rows,
            world_size=self.config.world_size,
            microbatches=self.settings.microbatches,
            temperature=self.settings.temperature,
            rank=self.rank,
        )
        skipped_before = actor.skipped_steps
        with self._capturing(capture_gradients):
            output = actor.train_mini_batch(data)
        skipped = actor.skipped_steps > skipped_before
        if not skipped:
            self._refresh_rollout()
        metrics = dict(output["metrics"]) if output is not None else {}
        return VerlStepResult(
            rank=self.rank,
            skipped=skipped,
            losses={} if skipped else _losses(metrics, self.settings.kl_coef),
            normalizers=dict(actor.last_normalizers or {}),
            round_latency_s=_number(metrics.get("lossreduce/round_latency_s", 0.0)),
            step_seconds=time.perf_counter() - start,
        )

    def gradients(self) -> dict[str, Tensor]:
        """Gradients (after verl's data-parallel average) captured by the last
        ``train(capture_gradients=True)``."""
        if self.captured_gradients is None:
            raise RuntimeError(f"rank {self.rank}: no gradients were captured")
        return self.captured_gradients

    def shutdown(self) -> None:
        if self._actor is not None:
            self._actor.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- internals -----------------------------------------------------------

    @contextmanager
    def _capturing(self, capture: bool) -> Iterator[None]:
        """With ``capture``, keep every gradient right before verl's optimizer step."""
        engine = self._actor.engine
        if not capture:
            yield
            return
        stock = engine.optimizer_step

        def step() -> Any:
            # Every rank gathers every gradient in the same order (a collective).
            self.captured_gradients = {
                name: _full(p.grad)
                for name, p in engine.module.named_parameters()
                if p.grad is not None
            }
            return stock()

        engine.optimizer_step = step
        try:
            yield
        finally:
            del engine.optimizer_step  # the class's method again

    @torch.no_grad()
    def _refresh_rollout(self) -> None:
        """The rollout copy takes the actor's weights (every rank gathers them alike)."""
        assert self._rollout is not None
        mine = dict(self._rollout.model.named_parameters())
        for name, param in self._actor.engine.module.named_parameters():
            mine[name].copy_(_full(param).to(self.device))


def _number(value: Any) -> float:
    """A metric verl returns as a number or a list of one per micro-batch or rank."""
    if isinstance(value, list | tuple):
        return float(sum(_number(v) for v in value) / max(1, len(value)))
    return float(value)


def _losses(metrics: dict[str, Any], kl_coef: float) -> dict[str, float]:
    out = {"pg": _number(metrics["actor/pg_loss"])}
    if "kl_loss" in metrics:
        out["kl"] = kl_coef * _number(metrics["kl_loss"])
    return out
