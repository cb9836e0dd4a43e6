"""SkyRL's FSDP critic worker with lossreduce's validated global normalizer.

SkyRL 0.4's critic (``CriticWorkerBase``) trains its value loss, ``ppo_critic_loss``:
each response's token mean of ``0.5 * max((clip(V) - R)^2, (V - R)^2)``, averaged over
each micro-batch's responses, the micro-batches' gradients averaged in ``optim_step``
(or, with ``max_tokens_per_microbatch``, weighted by their share of rows), with no
validation. That is a mean over the mini-batch's responses only where every
micro-batch is of one size, and a fully masked response counts as a zero.

:class:`LossReduceCriticWorker` takes the seam where a rank sees its whole share of a
critic mini-batch, ``forward_backward(data)``, and there, once per mini-batch and
before any forward:

1. the rank counts its active units of the value loss, the term ``vf``, in
   ``critic_mode`` (``token_mean`` by default);
2. the normalizer backend sums and validates the partials over the critic's
   data-parallel group, in the reduction group ``critic_group``: a NaN or inf return
   or old value at an active token makes the rank poison its partial, so it raises
   :class:`~lossreduce.errors.InvalidPartialError` naming itself, the input and its
   rows, and its peers :class:`~lossreduce.errors.RoundAbortedError` naming it; an
   empty mini-batch raises :class:`~lossreduce.errors.EmptyNormalizerError` on every
   rank, or with ``on_empty_step='skip'`` runs no forward, backward or optimizer step;
3. the micro-batches run SkyRL's critic forward and its value loss per token
   (:func:`~.plan.value_token_loss`) as ``sum_i (w_i / N) sum_t vf[i,t] m[i,t]``, the
   returns and old values zeroed under the loss mask first, times the data-parallel
   size (FSDP averages gradients over the ranks). ``optim_step`` then divides nothing.

The value loss of a mini-batch is thus the formula of docs/reduction-semantics.md over
its responses, however SkyRL splits it into ranks and micro-batches. The rounds, the
claim and the round counter in the checkpoint are :class:`~.rounds.SkyRLRoundsMixin`'s.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPCriticWorkerBase
from skyrl.backends.skyrl_train.workers.worker_utils import (
    BaseBatchIterator,
    all_reduce_metrics,
    get_microbatch_iterator,
    reduce_metrics,
)
from skyrl.train.dataset.replay_buffer import Experience

from lossreduce.trainer_worker.integrations.skyrl.plan import (
    VALUE_SCALE_FIELD,
    VALUE_TERM,
    row_scales,
    token_share,
    value_token_loss,
)
from lossreduce.trainer_worker.integrations.skyrl.rounds import SkyRLRoundsMixin
from lossreduce.trainer_worker.integrations.worker_rounds import round_metrics
from lossreduce.trainer_worker.policy_gradient import zero_masked
from lossreduce.trainer_worker.step_rows import TermPlan, bad_inputs, plan_terms

__all__ = ["LossReduceCriticWorker"]

_VALUE_INPUTS = ("returns", "values")
"""The critic's per-token inputs: checked at active tokens, zeroed under the loss mask."""


class LossReduceCriticWorker(SkyRLRoundsMixin, FSDPCriticWorkerBase):  # type: ignore[misc]
    """SkyRL's FSDP critic worker whose mini-batches are normalized by lossreduce (term
    ``vf``, mode ``critic_mode``, group ``critic_group``; see the module)."""

    role = "critic"

    def plan(self, data: TrainingInputBatch) -> tuple[TermPlan, list[str]]:
        """This rank's plan for the critic mini-batch share ``data`` and its bad inputs."""
        reductions = {VALUE_TERM: self.reduction_settings.critic_reduction}
        mask = data["loss_mask"].cpu()  # [B, T]
        tokens = (mask != 0).sum(-1).to(torch.float64)  # [B] D_i
        rows, rank = self._rows(data, tokens, reductions)
        inputs = {name: data[name].cpu() for name in _VALUE_INPUTS}
        found = bad_inputs(mask, inputs, self.mesh_rank.dp)
        return plan_terms(reductions, rows, rank), found

    def forward_backward(self, data: TrainingInputBatch) -> WorkerOutput:
        """One critic mini-batch share, normalized by lossreduce (see the module)."""
        step = self.rounds.next_step()
        plan, bad = self.plan(data)
        totals, latency = self._take_round(step, plan, bad, VALUE_TERM)
        if totals is None:
            return WorkerOutput(metrics=round_metrics(step, {}, latency, skipped=True))
        output = self._micro_batches(_normalized(data, row_scales(plan, totals)[VALUE_TERM]))
        output.metrics.update(round_metrics(step, totals, latency, skipped=False))
        return output

    def _micro_batches(self, data: TrainingInputBatch) -> WorkerOutput:
        """SkyRL's micro-batch loop (its iterator and metric reduction) around
        :meth:`_micro_step`."""
        iterator = get_microbatch_iterator(
            data,
            micro_batch_size=self.cfg.micro_train_batch_size_per_gpu,
            max_tokens_per_microbatch=self.cfg.max_tokens_per_microbatch,
        )
        metrics: dict[str, list[float]] = defaultdict(list)
        for micro_batch in iterator:
            # A padding micro-batch of the token-based iterator lacks the scale: it
            # weighs nothing.
            n = len(micro_batch)
            scale = micro_batch.get(VALUE_SCALE_FIELD, torch.zeros(n, dtype=torch.float64))
            experience = BaseBatchIterator.batch_to_experience(micro_batch)
            for key, value in self._micro_step(experience, scale).items():
                metrics[key].append(value)
        result = reduce_metrics(metrics, sum_loss_metrics=True)
        dp_group = self.device_mesh.get_group("dp")
        result = all_reduce_metrics(result, self.strategy, group=dp_group, sum_loss_metrics=True)
        return WorkerOutput(metrics=result)

    def _micro_step(self, experience: Experience, scale: torch.Tensor) -> dict[str, float]:
        """Forward, the value loss's share and backward of one micro-batch."""
        self.model.train()
        experience.to_device(torch.cuda.current_device())
        mask = experience.loss_mask  # [B, T]
        value_clip = self.cfg.algorithm.value_clip
        # SkyRL's own autocast (a no-op for its FSDP model, which casts itself).
        with torch.autocast(
            dtype=torch.bfloat16, device_type="cuda", enabled=torch.cuda.is_available()
        ):
            values, _ = self.model(
                experience.sequences,
                num_actions=experience.num_actions,
                attention_mask=experience.attention_mask,
                return_output=True,
            )  # [B, T]
        per_token = value_token_loss(values, experience.values, experience.returns, value_clip)
        share = token_share(per_token, mask, scale)
        # FSDP averages gradients over the data-parallel ranks; the share is a sum.
        self.strategy.backward(share * self.mesh_rank.dp_size, self.model, self.optimizer)
        status = {
            "critic_loss": share.item(),
            "values_mean": masked_mean(values, mask).item(),
            "critic_lr": self.scheduler.get_last_lr()[0],
        }
        if value_clip is not None:
            with torch.no_grad():
                # SkyRL's clip fraction: where the clipped value's loss is the larger.
                clipped = experience.values + (values - experience.values).clamp(
                    -value_clip, value_clip
                )
                worse = (clipped - experience.returns) ** 2 > (values - experience.returns) ** 2
                status["values_clipfrac"] = masked_mean(worse.float(), mask).item()
        return status


def _normalized(data: TrainingInputBatch, scale: torch.Tensor) -> TrainingInputBatch:
    """``data`` with the returns and old values zeroed under the loss mask and each
    row's ``w_i / N`` (``[B]``) as a field of its own."""
    out = TrainingInputBatch(dict(data))
    out.metadata = data.metadata
    mask = data["loss_mask"]
    for name in _VALUE_INPUTS:
        out[name] = zero_masked(data[name], mask)
    out[VALUE_SCALE_FIELD] = scale
    return out
