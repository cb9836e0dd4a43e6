"""The actor loss of one verl micro-batch, normalized by the mini-batch's global normalizers.

verl's own ``ppo_loss`` divides by ``batch_num_tokens`` or by the constant
``global_batch_size`` (which counts fully masked responses). This loss keeps
verl's per-token losses (its registered policy loss, its ``kl_penalty``, the
engine's entropy) and replaces every division:

- the policy loss runs with ``loss_agg_mode='token-sum'`` and no global batch
  info, and the row weights ``w_i`` of :mod:`.plan` enter through its
  ``rollout_is_weights`` (multiplied into any weights verl already has), so it
  returns ``sum_i w_i sum_t l[i,t] m[i,t]`` over the micro-batch;
- the KL and entropy sums are taken under the response mask;
- each sum is divided by its term's global normalizer and multiplied by the
  data-parallel size, as verl's own loss is (FSDP averages gradients over the
  data-parallel ranks; this undoes that average).

Inputs are zeroed under the mask first, so a NaN in a masked position reaches
neither the loss nor a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from verl.trainer.ppo.core_algos import get_policy_loss_fn, kl_penalty
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from lossreduce.trainer_worker.integrations.verl.plan import ENTROPY_TERM, KL_TERM, POLICY_TERM
from lossreduce.trainer_worker.policy_gradient import zero_masked

__all__ = ["ROW_WEIGHT_KEY", "StepNormalizers", "micro_batch_loss", "padded"]

ROW_WEIGHT_KEY = "lossreduce_row_weight"
"""The mini-batch field holding each row's weight ``w_i`` ([B] float); verl's
micro-batching selects it with the row, whatever the split or reordering."""


@dataclass(frozen=True)
class StepNormalizers:
    """One mini-batch's global normalizers, by term (as the round answered them)."""

    values: dict[str, float]

    def of(self, term: str) -> float:
        return self.values[term]


def padded(values: Tensor) -> Tensor:
    """``values`` as a padded ``[B, T]`` tensor (verl keeps some fields nested)."""
    return values.to_padded_tensor(0.0) if values.is_nested else values


def micro_batch_loss(
    normalizers: StepNormalizers,
    sum_config: Any,
    model_output: dict[str, Any],
    data: Any,
    dp_group: Any = None,
) -> tuple[Tensor, dict[str, Any]]:
    """``(loss, metrics)`` of one micro-batch: its share of the mini-batch's global loss.

    ``sum_config`` is the actor's ``ActorConfig`` with ``global_batch_info`` set to
    ``{"dp_size": 1}``, so verl's aggregation in ``token-sum`` returns a plain sum.
    """
    del dp_group  # the normalizers are already global
    log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [b, R]
    entropy = model_output.get("entropy")
    mask = padded(data["response_mask"]).bool()  # [b, R]
    # Sums in at least float32, as verl's own loss (log-probabilities may be bfloat16).
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    weight = data[ROW_WEIGHT_KEY].to(dtype)  # [b]
    dp_size = float(data["dp_size"])
    rows = weight[:, None].expand_as(log_prob)  # [b, R]
    advantages = zero_masked(padded(data["advantages"]).to(dtype), mask)
    old_log_prob = zero_masked(padded(data["old_log_probs"]).to(dtype), mask)
    if "rollout_is_weights" in data.keys():  # noqa: SIM118 (TensorDict refuses `in`)
        rows = rows * zero_masked(padded(data["rollout_is_weights"]).to(dtype), mask)
    policy_loss_fn = get_policy_loss_fn(sum_config.policy_loss.get("loss_mode", "vanilla"))
    pg_sum, pg_metrics = policy_loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="token-sum",
        config=sum_config,
        rollout_is_weights=rows,
    )
    pg = pg_sum * (dp_size / normalizers.of(POLICY_TERM))
    metrics: dict[str, Any] = Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN)
    metrics["actor/pg_loss"] = Metric(value=pg, aggregation=AggregationType.SUM)
    loss = pg
    if entropy is not None:
        entropy_sum = torch.where(mask, no_padding_2_padding(entropy, data), 0.0).sum()
        if ENTROPY_TERM in normalizers.values:
            entropy_loss = entropy_sum * (dp_size / normalizers.of(ENTROPY_TERM))
            loss = loss - sum_config.entropy_coeff * entropy_loss
        else:
            # Reported only (entropy_coeff == 0): no term, so no normalizer of its own.
            entropy_loss = entropy_sum.detach() * 0.0
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=AggregationType.SUM)
    if KL_TERM in normalizers.values:
        ref_log_prob = zero_masked(padded(data["ref_log_prob"]).to(dtype), mask)
        kld = kl_penalty(
            logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=sum_config.kl_loss_type
        )
        kl_loss = torch.where(mask, kld, 0.0).sum() * (dp_size / normalizers.of(KL_TERM))
        loss = loss + sum_config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=AggregationType.SUM)
        metrics["kl_coef"] = sum_config.kl_loss_coef
    return loss, metrics
