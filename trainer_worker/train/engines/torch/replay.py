"""``--verify``'s reference for the torch engine: the same step in one process.

The batch the workers trained on is replayed with all of its data in this
process, through the same :class:`~lossreduce.trainer_worker.engine.TorchTrainEngine`
with the rounds of a one-rank world (a local normalizer); the
gradients it leaves are what the workers' summed gradients must equal
(:func:`~lossreduce.trainer_worker.train.verify.compare_gradients`).
"""

from __future__ import annotations

import torch

from lossreduce.trainer_worker.engine import TorchTrainEngine
from lossreduce.trainer_worker.microbatch import MicrobatchSettings, MicrobatchSplitter
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.train.engines.torch.grpo import GRPOLoss
from lossreduce.trainer_worker.train.engines.torch.rounds import EngineRounds, engine_rounds
from lossreduce.trainer_worker.train.engines.torch.worker import build_policy
from lossreduce.trainer_worker.train.rollouts import RolloutBatch
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["single_process_gradients"]


def single_process_gradients(
    settings: TrainSettings, job: str, batch: RolloutBatch
) -> tuple[dict[str, torch.Tensor], float]:
    """The same step in this process on all the data: (gradients, total loss)."""
    device = torch.device("cpu")
    policy = build_policy(settings, device)
    loss = GRPOLoss(
        PolicyGradientMode(settings.mode),
        divisor=settings.effective_divisor,
        kl_coef=settings.kl_coef,
        clip_eps=settings.clip_eps,
        prompt_len=batch.prompt_len,
        temperature=settings.temperature,
    )
    captured: dict[str, torch.Tensor] = {}

    def capture(model: torch.nn.Module) -> None:
        captured.update(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )

    engine = TorchTrainEngine(
        policy,
        torch.optim.Adam(policy.parameters(), lr=settings.lr),
        engine_rounds(
            EngineRounds(
                job=job,
                normalizer="torch",
                run=settings.run,
                on_empty_step="raise",
                call_timeout_s=settings.round_timeout_s,
            ),
            rank=0,
            world_size=1,
            device=device,
        ).normalizer(),
        MicrobatchSplitter(MicrobatchSettings(n_microbatches=settings.microbatches)),
        forward_fn=loss.forward,
        on_empty_step="raise",
        grad_sync=capture,
    )
    stats = engine.train_batch_with_reduction(batch.as_input(device), loss.reduction)
    return captured, stats.loss
