"""The actor loss of one verl micro-batch, normalized by the mini-batch's global normalizers.

verl's own ``ppo_loss`` divides by ``batch_num_tokens`` or by the constant
``global_batch_size`` (which counts fully masked responses). This loss keeps
verl's per-token losses (its registered policy loss, its ``kl_penalty``, the
engine's entropy) and replaces every division:

- the policy loss is verl's registered function, called with
  ``loss_agg_mode='token-sum'`` and no global batch info, so it returns a plain
  sum over the micro-batch; the row weights ``w_i`` of :mod:`.plan` enter through
  its ``rollout_is_weights`` (multiplied into any weights verl already has), so
  it returns ``sum_i w_i sum_t l[i,t] m[i,t]``. Losses that do not fit that
  call are dispatched in :func:`policy_sum` (``sapo``, ``geo_mean``, and the
  statistics of ``clip_cov``, ``kl_cov`` and ``bypass_mode``; see
  :mod:`.policy_losses`);
- the KL and entropy sums are taken under the response mask;
- each sum is divided by its term's global normalizer and multiplied by the
  data-parallel size, as verl's own loss is (FSDP averages gradients over the
  data-parallel ranks; this undoes that average).

Inputs are zeroed under the mask first, so a NaN in a masked position reaches
neither the loss nor a gradient.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from verl.trainer.ppo.core_algos import (
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    kl_penalty,
)
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from lossreduce.trainer_worker.integrations.verl.plan import ENTROPY_TERM, KL_TERM, POLICY_TERM
from lossreduce.trainer_worker.integrations.verl.policy_losses import (
    LossUnit,
    Statistic,
    VerlPolicyLoss,
    policy_loss,
    policy_option,
)
from lossreduce.trainer_worker.integrations.verl.settings import StatisticsScope
from lossreduce.trainer_worker.policy_gradient import zero_masked

__all__ = [
    "ROW_WEIGHT_KEY",
    "SELECTED_KEY",
    "PolicyLossRun",
    "StepNormalizers",
    "micro_batch_loss",
    "padded",
    "policy_sum",
]

ROW_WEIGHT_KEY = "lossreduce_row_weight"
"""The mini-batch field holding each row's weight ``w_i`` ([B] float); verl's
micro-batching selects it with the row, whatever the split or reordering."""

SELECTED_KEY = "lossreduce_selected"
"""The mini-batch field holding the tokens the mini-batch's statistic selected
([B, R] float, 1 where selected): ``clip_cov``'s drawn tokens, ``kl_cov``'s tokens
of largest covariance. Present only when the statistic is taken over the mini-batch."""


@dataclass(frozen=True)
class StepNormalizers:
    """One mini-batch's global normalizers, by term (as the round answered them)."""

    values: dict[str, float]

    def of(self, term: str) -> float:
        return self.values[term]


@dataclass(frozen=True)
class PolicyLossRun:
    """How the micro-batches of one mini-batch call verl's policy loss.

    ``config`` is the actor's ``ActorConfig`` with ``global_batch_info`` set to
    ``{"dp_size": 1}`` (verl's aggregation in ``token-sum`` is then a plain sum).
    ``importance_mean``: ``bypass_mode``'s mean importance weight over the whole
    mini-batch, which its weights are divided by (None: not normalized over the
    mini-batch).
    """

    config: Any
    scope: StatisticsScope
    importance_mean: float | None = None

    @property
    def loss(self) -> VerlPolicyLoss:
        found = policy_loss(self.config.policy_loss.get("loss_mode", "vanilla"))
        assert found is not None, "the options check refuses unknown losses at start"
        return found

    def over_mini_batch(self) -> bool:
        """The loss's statistic is taken over the whole mini-batch (not per call)."""
        return self.loss.statistic is not Statistic.NONE and self.scope == "mini_batch"


def padded(values: Tensor) -> Tensor:
    """``values`` as a padded ``[B, T]`` tensor (verl keeps some fields nested)."""
    return values.to_padded_tensor(0.0) if values.is_nested else values


def _with_policy_loss(config: Any, **fields: Any) -> Any:
    return dataclasses.replace(
        config, policy_loss=dataclasses.replace(config.policy_loss, **fields)
    )


def policy_sum(
    run: PolicyLossRun,
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rows: Tensor,
    importance: Tensor | None,
    selected: Tensor | None,
) -> tuple[Tensor, dict[str, Any]]:
    """``(sum_i w_i sum_t l[i,t] m[i,t], metrics)`` of one micro-batch, ``l`` from verl.

    All tensors are ``[b, R]`` but ``rows`` (``[b]``, the row weights ``w_i``);
    ``importance``: verl's ``rollout_is_weights`` of the batch, if any; ``selected``:
    the mini-batch statistic's selected tokens (``clip_cov``, ``kl_cov``), if taken.
    """
    loss, config = run.loss, run.config
    token_rows = rows[:, None].expand_as(log_prob)  # [b, R]
    if loss.name == "bypass_mode":
        # verl's bypass_mode ignores the batch's rollout_is_weights: it computes its own.
        importance = None
    if importance is not None:
        token_rows = token_rows * importance
    call = {
        "old_log_prob": old_log_prob,
        "log_prob": log_prob,
        "advantages": advantages,
        "response_mask": mask,
        "loss_agg_mode": "token-sum",
    }
    name = loss.name
    if name == "bypass_mode":
        return _bypass_sum(run, call, token_rows)
    if name == "sapo":
        # verl aggregates SAPO as seq-mean-token-mean whatever loss_agg_mode says; with a
        # global batch size of 1 that is the sum over rows of each row's token mean, and
        # seq_mean (its only mode) weighs every active row 1.
        active = (mask.sum(-1) > 0).to(log_prob.dtype)  # [b]
        config = dataclasses.replace(
            config, global_batch_info={"dp_size": 1, "global_batch_size": 1}
        )
        weights = active[:, None] * (importance if importance is not None else 1.0)
        return _verl(name, call, config, weights)
    if loss.unit is LossUnit.SEQUENCE:
        # geo_mean: torch.mean over the call's rows of -A_i * r_i. Scaling A_i by the row's
        # weight (1 for every active row; its only mode is seq_mean) scales that row's loss,
        # signs and clipping unchanged; times the rows it is the weighted sum.
        active = (mask.sum(-1) > 0).to(advantages.dtype)  # [b]
        call["advantages"] = advantages * active[:, None]
        mean, metrics = _verl(name, call, config, importance)
        return mean * log_prob.shape[0], metrics
    if selected is not None and name == "clip_cov":
        # verl's own draw off (no covariance lies above +inf), the mini-batch's draw in the
        # weights: a drawn token's loss is zeroed, as verl's `corr` does.
        off = _with_policy_loss(config, clip_cov_lb=math.inf)
        total, metrics = _verl(name, call, off, token_rows * (1.0 - selected))
        metrics["actor/pg_clipfrac"] = _fraction(selected, mask)
        return total, metrics
    if selected is not None and name == "kl_cov":
        # verl's own selection without effect (a KL coefficient of 0), the mini-batch's
        # selection penalized here with verl's term: ppo_kl_coef * |log p - log p_old|.
        coef = policy_option(config.policy_loss, "ppo_kl_coef")
        off = _with_policy_loss(config, ppo_kl_coef=0.0)
        total, metrics = _verl(name, call, off, token_rows)
        penalty = coef * (log_prob - old_log_prob).abs()
        total = total + torch.where(mask, token_rows * selected * penalty, 0.0).sum()
        metrics["actor/kl_cov_fraction"] = _fraction(selected, mask)
        return total, metrics
    return _verl(name, call, config, token_rows)


def _verl(
    name: str, call: dict[str, Any], config: Any, weights: Tensor | None
) -> tuple[Tensor, dict[str, Any]]:
    """verl's registered policy loss ``name``, as ``ppo_loss`` calls it."""
    total, metrics = get_policy_loss_fn(name)(**call, config=config, rollout_is_weights=weights)
    return total, dict(metrics)


def _fraction(selected: Tensor, mask: Tensor) -> float:
    return float((selected * mask).sum() / mask.sum().clamp(min=1))


def _bypass_sum(
    run: PolicyLossRun, call: dict[str, Any], token_rows: Tensor
) -> tuple[Tensor, dict[str, Any]]:
    """verl's ``bypass_mode`` dispatch with the row weights: the importance weights and
    the rejection mask from verl's helper, then verl's REINFORCE (importance weights times
    the rows) or PPO-clip (the rows alone: its ratio is already the importance ratio)."""
    correction = run.config.policy_loss.rollout_correction
    mask = call["response_mask"]
    log_prob, rollout_log_prob = call["log_prob"], call["old_log_prob"]
    if not bool(mask.any()):
        # verl raises on a call without an active token. Such a call adds nothing, yet the
        # rank takes part in the step (its peers would wait for it otherwise) and reports
        # the metrics every call reports (verl aggregates them call by call): run the
        # same path on a mask of all ones, then keep none of it, metrics 0 as verl's
        # masked means of an empty call are.
        total, metrics = _bypass_sum(
            run, {**call, "response_mask": torch.ones_like(mask)}, token_rows
        )
        return total * 0.0, dict.fromkeys(metrics, 0.0)
    normalize = correction.get("rollout_is_batch_normalize", False) and run.scope == "per_call"
    with torch.no_grad():
        weights_proto, effective_mask, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob,  # the current policy, as verl passes it
            rollout_log_prob=rollout_log_prob,
            response_mask=mask,
            rollout_is=correction.get("rollout_is", None),
            rollout_is_threshold=correction.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=False,
            rollout_rs=correction.get("rollout_rs", None),
            rollout_rs_threshold=correction.get("rollout_rs_threshold", None),
        )
    importance = None if weights_proto is None else weights_proto.batch["rollout_is_weights"]
    if importance is not None:
        mean = run.importance_mean
        if normalize:
            mean = float(_call_importance_mean(importance, mask, correction.get("rollout_is")))
        if mean is not None and mean > 1e-8:  # verl leaves a vanishing mean unnormalized
            importance = importance / mean
    call = {**call, "response_mask": effective_mask.bool()}
    if correction.get("loss_type", "ppo_clip") == "reinforce":
        rollout_log_prob = call.pop("old_log_prob")
        weights = token_rows if importance is None else token_rows * importance
        total, pg_metrics = compute_policy_loss_reinforce(
            rollout_log_prob=rollout_log_prob, **call, config=run.config, rollout_is_weights=weights
        )
    else:
        total, pg_metrics = compute_policy_loss_vanilla(
            **call, config=run.config, rollout_is_weights=token_rows
        )
    pg_metrics.update(metrics)
    return total, pg_metrics


def _call_importance_mean(importance: Tensor, mask: Tensor, level: str | None) -> Tensor:
    """verl's batch normalization factor over one call alone (``statistics='per_call'``):
    the mean weight over the call's active tokens, or over its active responses."""
    if level == "sequence":
        tokens = mask.sum(-1)  # [b]
        per_row = torch.where(mask, importance, 0.0).sum(-1) / tokens.clamp(min=1)
        active = tokens > 0
        return per_row[active].sum() / active.sum().clamp(min=1)
    return torch.where(mask, importance, 0.0).sum() / mask.sum().clamp(min=1)


def micro_batch_loss(
    normalizers: StepNormalizers,
    run: PolicyLossRun,
    model_output: dict[str, Any],
    data: Any,
    dp_group: Any = None,
) -> tuple[Tensor, dict[str, Any]]:
    """``(loss, metrics)`` of one micro-batch: its share of the mini-batch's global loss."""
    del dp_group  # the normalizers are already global
    log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [b, R]
    entropy = model_output.get("entropy")
    mask = padded(data["response_mask"]).bool()  # [b, R]
    width = mask.shape[1]
    # Sums in at least float32, as verl's own loss (log-probabilities may be bfloat16).
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    rows = data[ROW_WEIGHT_KEY].to(dtype)  # [b]
    dp_size = float(data["dp_size"])
    importance = None
    if "rollout_is_weights" in data.keys():  # noqa: SIM118 (TensorDict refuses `in`)
        importance = zero_masked(padded(data["rollout_is_weights"]).to(dtype), mask)
    selected = None
    if SELECTED_KEY in data.keys():  # noqa: SIM118
        selected = data[SELECTED_KEY][:, :width].to(dtype)  # [b, R]
    pg_sum, pg_metrics = policy_sum(
        run,
        old_log_prob=zero_masked(padded(data["old_log_probs"]).to(dtype), mask),
        log_prob=log_prob,
        advantages=zero_masked(padded(data["advantages"]).to(dtype), mask),
        mask=mask,
        rows=rows,
        importance=importance,
        selected=selected,
    )
    config = run.config
    pg = pg_sum * (dp_size / normalizers.of(POLICY_TERM))
    metrics: dict[str, Any] = Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN)
    metrics["actor/pg_loss"] = Metric(value=pg, aggregation=AggregationType.SUM)
    loss = pg
    if entropy is not None:
        entropy_sum = torch.where(mask, no_padding_2_padding(entropy, data), 0.0).sum()
        if ENTROPY_TERM in normalizers.values:
            entropy_loss = entropy_sum * (dp_size / normalizers.of(ENTROPY_TERM))
            loss = loss - config.entropy_coeff * entropy_loss
        else:
            # Reported only (entropy_coeff == 0): no term, so no normalizer of its own.
            entropy_loss = entropy_sum.detach() * 0.0
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=AggregationType.SUM)
    if KL_TERM in normalizers.values:
        ref_log_prob = zero_masked(padded(data["ref_log_prob"]).to(dtype), mask)
        kld = kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)
        kl_loss = torch.where(mask, kld, 0.0).sum() * (dp_size / normalizers.of(KL_TERM))
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=AggregationType.SUM)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics
