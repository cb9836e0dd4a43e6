"""``TrainerWorker``: one data-parallel rank, run as a Ray actor.

Each worker holds a full replica of the policy (and, with a KL term, a frozen
reference copy) on its device — CUDA when present, else CPU — and, per step:

1. samples responses for its slice of the step's prompts (:meth:`sample`);
2. trains on its shard of whole prompt groups (:meth:`train`) through the
   reduction library's :class:`TorchTrainEngine`: microbatches, per-term
   partials, one global reduction (coordinator or torch.distributed), scaled
   backward, a SUM all-reduce of the gradients, one Adam step.

Every rank initializes the policy from the same seed, and the summed
gradients are identical everywhere, so the replicas stay identical without a
broadcast. The class is plain Python; the driver wraps it with ``ray.remote``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lossreduce.trainer_worker.engine import TorchTrainEngine
from lossreduce.trainer_worker.integrations.worker_rounds import WorkerRounds
from lossreduce.trainer_worker.microbatch import MicrobatchSettings, MicrobatchSplitter
from lossreduce.trainer_worker.normalizers import GlobalNormalizer, NormalizerHandle
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.train.engines.rank import RankActor, RankConfig, sample_slice
from lossreduce.trainer_worker.train.engines.torch.grpo import GRPOLoss
from lossreduce.trainer_worker.train.engines.torch.model import CausalTransformer, PolicyConfig
from lossreduce.trainer_worker.train.engines.torch.rounds import EngineRounds, engine_rounds
from lossreduce.trainer_worker.train.metrics import WorkerMetrics
from lossreduce.trainer_worker.train.rollouts import (
    RolloutBatch,
    Samples,
)
from lossreduce.trainer_worker.train.task import INPUT_VOCAB, OUTPUT_VOCAB, stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = [
    "TimedNormalizer",
    "TrainerWorker",
    "WorkerConfig",
    "WorkerStepResult",
    "build_policy",
]


class WorkerConfig(RankConfig):
    """What one rank needs to start."""


@dataclass(frozen=True)
class WorkerStepResult:
    """What a rank reports after a step; losses and normalizers are global."""

    rank: int
    skipped: bool
    skip_reason: str
    losses: dict[str, float]
    normalizers: dict[str, float]
    round_latency_s: float
    """This rank's normalizer round, from its start to its answer."""
    step_seconds: float
    normalizer_wait_s: float = 0.0
    """Time this rank was blocked waiting for the round (the rest hid behind its forward)."""


class TimedNormalizer:
    """A :class:`GlobalNormalizer` that remembers how long its last blocking
    ``reduce`` took. ``start`` is passed through: an engine that overlaps the
    round times it itself (:attr:`StepStats.round_latency_s`)."""

    def __init__(self, inner: GlobalNormalizer) -> None:
        self.inner = inner
        self.last_seconds = 0.0

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        return self.inner.start(step, partials, contracts)

    def reduce(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, Tensor]:
        start = time.perf_counter()
        try:
            return self.inner.reduce(step, partials, contracts)
        finally:
            self.last_seconds = time.perf_counter() - start


def build_policy(settings: TrainSettings, device: torch.device) -> CausalTransformer:
    """The policy every rank (and the verifier) starts from: same seed, same weights."""
    torch.manual_seed(stream_seed(settings.seed, "init"))
    config = PolicyConfig(
        input_vocab=INPUT_VOCAB,
        output_vocab=OUTPUT_VOCAB,
        max_len=1 + settings.prompt_len + settings.response_len,
        d_model=settings.d_model,
        n_heads=settings.heads,
        n_layers=settings.layers,
    )
    return CausalTransformer(config).to(device)


def sum_gradients(model: nn.Module) -> None:
    """All-reduce (SUM) every gradient in one flat buffer: the scaled losses
    already divide by the global normalizer, so ranks' gradients add up."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class TrainerWorker(RankActor):
    """One rank: a policy replica, its optimizer and the reduction engine."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.settings = config.settings
        self.rank = config.rank
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            # One bundle = one CPU: more threads only fight the other ranks.
            torch.set_num_threads(1)
        self.policy = build_policy(self.settings, self.device)
        self.reference: nn.Module | None = None
        if self.settings.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.settings.lr)
        self.loss = GRPOLoss(
            PolicyGradientMode(self.settings.mode),
            divisor=self.settings.effective_divisor,
            kl_coef=self.settings.kl_coef,
            clip_eps=self.settings.clip_eps,
            prompt_len=1 + self.settings.prompt_len,
            temperature=self.settings.temperature,
        )
        self.metrics = WorkerMetrics(config.job)
        self._normalizer: TimedNormalizer | None = None
        self._engine: TorchTrainEngine | None = None
        self._rounds: WorkerRounds | None = None
        self._capture = False
        self.captured_gradients: dict[str, Tensor] | None = None

    # -- setup ---------------------------------------------------------------

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the process group and connect the normalizer backend."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.config.world_size,
            timeout=timedelta(seconds=self.settings.round_timeout_s + 30),
        )
        self._rounds = engine_rounds(
            EngineRounds(
                job=self.config.job,
                normalizer=self.settings.normalizer,
                run=self.settings.run,
                on_empty_step=self.settings.on_empty_step,
                call_timeout_s=self.settings.round_timeout_s + 30,
                coordinator=self.config.coordinator,
                token=self.config.coordinator_token,
                tls_ca=self.config.coordinator_tls_ca,
            ),
            rank=self.rank,
            world_size=self.config.world_size,
            device=self.device,
        )
        inner = self._rounds.normalizer()
        self._normalizer = TimedNormalizer(inner)
        self._engine = TorchTrainEngine(
            self.policy,
            self.optimizer,
            self._normalizer,
            MicrobatchSplitter(MicrobatchSettings(n_microbatches=self.settings.microbatches)),
            forward_fn=self.loss.forward,
            on_empty_step=self.settings.on_empty_step,
            grad_sync=self._sync_gradients,
        )

    # -- per step ------------------------------------------------------------

    def sample(self, step: int, prompt_tokens: Tensor, first_prompt: int) -> Samples:
        """Responses for prompts ``first_prompt ...`` of ``step``, on CPU."""
        self.policy.eval()
        return sample_slice(
            self.settings,
            self.policy,
            self.reference,
            step=step,
            prompt_tokens=prompt_tokens,
            first_prompt=first_prompt,
            device=self.device,
        )

    def train(
        self, step: int, shard: RolloutBatch, reward: float, capture_gradients: bool = False
    ) -> WorkerStepResult:
        """One optimizer step on this rank's shard (or a skip, on every rank alike)."""
        engine, _ = self._require_setup()
        if engine.step != step:
            raise RuntimeError(
                f"rank {self.rank}: asked for step {step}, engine is at {engine.step}"
            )
        start = time.perf_counter()
        self._capture = capture_gradients
        stats = engine.train_batch_with_reduction(shard.as_input(self.device), self.loss.reduction)
        losses = {} if stats.skipped else self._global_sums(stats.terms)
        seconds = time.perf_counter() - start
        self.metrics.record_step(seconds, losses, stats.normalizers, reward, stats.skipped)
        return WorkerStepResult(
            rank=self.rank,
            skipped=stats.skipped,
            skip_reason=stats.skip_reason,
            losses=losses,
            normalizers=dict(stats.normalizers),
            round_latency_s=stats.round_latency_s,
            step_seconds=seconds,
            normalizer_wait_s=stats.normalizer_wait_s,
        )

    def gradients(self) -> dict[str, Tensor]:
        """Gradients (after the all-reduce) captured by the last ``train(capture_gradients=True)``."""
        if self.captured_gradients is None:
            raise RuntimeError(f"rank {self.rank}: no gradients were captured")
        return self.captured_gradients

    def shutdown(self) -> None:
        if self._rounds is not None:
            self._rounds.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- internals -----------------------------------------------------------

    def _require_setup(self) -> tuple[TorchTrainEngine, TimedNormalizer]:
        if self._engine is None or self._normalizer is None:
            raise RuntimeError(f"rank {self.rank}: setup() was not called")
        return self._engine, self._normalizer

    def _sync_gradients(self, model: nn.Module) -> None:
        sum_gradients(model)
        if self._capture:
            self.captured_gradients = {
                name: p.grad.detach().cpu().clone()
                for name, p in model.named_parameters()
                if p.grad is not None
            }

    def _global_sums(self, shares: Mapping[str, float]) -> dict[str, float]:
        """Every term's global loss: this rank's shares summed over ranks in rank order."""
        names = list(shares)  # the reduction's term order, the same on every rank
        local = torch.tensor([shares[n] for n in names], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(local) for _ in range(self.config.world_size)]
        dist.all_gather(rows, local)
        return {name: math.fsum(float(row[i]) for row in rows) for i, name in enumerate(names)}
