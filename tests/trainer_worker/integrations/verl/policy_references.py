"""What one PPO mini-batch should do, computed in one process, without verl's engine.

Hugging Face's forward of the tiny Qwen2 over the whole mini-batch, then:

- the actor (:func:`policy_update`): verl's own policy-loss function, called **once on
  the whole mini-batch** with verl's own aggregation for the mode (``token_mean``:
  ``token-mean``; ``seq_mean``: ``seq-mean-token-mean``; ``constant``:
  ``seq-mean-token-sum-norm`` with ``loss_scale_factor = C``; ``prompt_mean``, which verl
  lacks: a ``token-mean`` call per prompt group, averaged over the active groups), so
  a statistic verl takes over its call is taken over the whole mini-batch here; plus
  verl's KL penalty and the entropy as token means over the active tokens;
- the critic (:func:`value_update`): the clipped value loss of the reduction
  semantics' formulas, written out here.

With plain SGD at lr 1 the update is minus the gradient.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

from tests.trainer_worker.integrations.verl import tiny_verl

VERL_AGGREGATION = {
    "token_mean": "token-mean",
    "seq_mean": "seq-mean-token-mean",
    "constant": "seq-mean-token-sum-norm",
}


def _rows(batch: tiny_verl.Rows, pick: list[int]) -> tiny_verl.Rows:
    return tiny_verl.select(batch, pick)


def _policy_sum(
    config: Any,
    batch: tiny_verl.Rows,
    lp: torch.Tensor,
    agg: str,
    scale: float | None,
    *,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    info = {} if scale is None else {"loss_scale_factor": scale}
    call_config = dataclasses.replace(config, global_batch_info=info)
    loss, _ = get_policy_loss_fn(config.policy_loss.loss_mode)(
        old_log_prob=batch.old_log_probs,
        log_prob=lp,
        advantages=batch.advantages,
        response_mask=batch.response_mask.bool(),
        loss_agg_mode=agg,
        config=call_config,
        rollout_is_weights=weights,
    )
    return loss  # type: ignore[no-any-return]


def _bypass_sum(
    config: Any, batch: tiny_verl.Rows, lp: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """verl's bypass_mode over the whole mini-batch as a token sum weighted by ``weights``
    ([B, R]): bypass_mode takes no weights, so its two steps are called here (verl's
    correction helper, then its REINFORCE or PPO-clip loss)."""
    from verl.trainer.ppo.core_algos import (
        compute_policy_loss_reinforce,
        compute_policy_loss_vanilla,
    )
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    correction = config.policy_loss.rollout_correction
    mask = batch.response_mask.bool()
    with torch.no_grad():
        proto, kept, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=lp,
            rollout_log_prob=batch.old_log_probs,
            response_mask=mask,
            rollout_is=correction.rollout_is,
            rollout_is_threshold=correction.rollout_is_threshold,
            rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
            rollout_rs=correction.rollout_rs,
            rollout_rs_threshold=correction.rollout_rs_threshold,
        )
    call_config = dataclasses.replace(config, global_batch_info={})
    if correction.loss_type == "reinforce":
        importance = proto.batch["rollout_is_weights"]
        loss, _ = compute_policy_loss_reinforce(
            rollout_log_prob=batch.old_log_probs,
            log_prob=lp,
            advantages=batch.advantages,
            response_mask=kept.bool(),
            loss_agg_mode="token-sum",
            config=call_config,
            rollout_is_weights=importance * weights,
        )
    else:
        loss, _ = compute_policy_loss_vanilla(
            old_log_prob=batch.old_log_probs,
            log_prob=lp,
            advantages=batch.advantages,
            response_mask=kept.bool(),
            loss_agg_mode="token-sum",
            config=call_config,
            rollout_is_weights=weights,
        )
    return loss  # type: ignore[no-any-return]


def mode_weights(batch: tiny_verl.Rows, mode: str, divisor: float | None) -> torch.Tensor:
    """``[B, R]``: each row's weight in ``mode`` as a token sum over the whole mini-batch
    (``D_i``, ``D_g`` and the counts from the response mask before any rejection):
    ``token_mean`` ``1 / N``; ``seq_mean`` ``1 / (D_i N)``; ``constant`` ``1 / (C N)``;
    ``prompt_mean`` ``1 / (D_g N)``, 0 at inactive rows."""
    mask = batch.response_mask.bool()
    d = mask.sum(-1).double()  # [B]
    active = d > 0
    row = torch.zeros(batch.size, dtype=torch.float64)
    if mode == "token_mean":
        row[active] = 1.0 / float(d.sum())
    elif mode == "seq_mean":
        row[active] = 1.0 / (d[active] * int(active.sum()))
    elif mode == "constant":
        assert divisor is not None
        row[active] = 1.0 / (divisor * int(active.sum()))
    else:
        in_group = {g: torch.tensor([u == g for u in batch.uid]) for g in sorted(set(batch.uid))}
        groups = [g for g, rows in in_group.items() if float(d[rows].sum()) > 0]
        for g in groups:
            row[in_group[g]] = 1.0 / (float(d[in_group[g]].sum()) * len(groups))
    return row[:, None].expand(mask.shape).float()


def policy_loss(
    model: torch.nn.Module,
    batch: tiny_verl.Rows,
    config: Any,
    mode: str,
    divisor: float | None,
    *,
    kl_coef: float,
    entropy_coeff: float,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mini-batch's loss (see the module docstring). ``token_weights`` (``[B, R]``):
    a token mean weighted by them instead of the mode's aggregation (``clip_cov`` with
    its draw turned off and the drawn tokens weighed 0)."""
    lp, entropy = tiny_verl._log_probs(model, batch)  # [B, R] each
    mask = batch.response_mask.bool()
    active = [i for i in range(batch.size) if bool(mask[i].any())]
    name = config.policy_loss.loss_mode
    if token_weights is not None:
        pg = _policy_sum(config, batch, lp, "token-mean", None, weights=token_weights)
    elif name == "geo_mean":
        # One loss per response, averaged over the call's rows: the active ones only.
        pg = _policy_sum(config, _rows(batch, active), lp[active], "token-mean", None)
    elif name == "bypass_mode":
        # Its rejected tokens leave the numerator and keep their place in every count
        # (verl's own seq-mean modes would count a response's kept tokens instead).
        pg = _bypass_sum(config, batch, lp, mode_weights(batch, mode, divisor))
    elif mode == "prompt_mean":
        # verl has no such aggregation: its token sum, weighted by the formula's weights,
        # over the whole mini-batch (so a statistic stays the mini-batch's).
        weights = mode_weights(batch, mode, divisor)
        pg = _policy_sum(config, batch, lp, "token-sum", None, weights=weights)
    else:
        pg = _policy_sum(config, batch, lp, VERL_AGGREGATION[mode], divisor)
    tokens = mask.sum()
    loss = pg - entropy_coeff * torch.where(mask, entropy, 0.0).sum() / tokens
    if kl_coef:
        from verl.trainer.ppo.core_algos import kl_penalty

        kl = kl_penalty(logprob=lp, ref_logprob=batch.ref_log_prob, kl_penalty="low_var_kl")
        loss = loss + kl_coef * torch.where(mask, kl, 0.0).sum() / tokens
    return loss


def policy_update(
    model_dir: Path,
    batch: tiny_verl.Rows,
    config: Any,
    mode: str,
    divisor: float | None = None,
    *,
    kl_coef: float = tiny_verl.KL_COEF,
    entropy_coeff: float = tiny_verl.ENTROPY_COEFF,
    lr: float = 1.0,
    token_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter's SGD update by the actor loss of :func:`policy_loss`."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float()
    loss = policy_loss(
        model,
        batch,
        config,
        mode,
        divisor,
        kl_coef=kl_coef,
        entropy_coeff=entropy_coeff,
        token_weights=token_weights,
    )
    loss.backward()
    return {n: -lr * p.grad for n, p in model.named_parameters() if p.grad is not None}


def value_update(
    value_dir: Path,
    batch: tiny_verl.Rows,
    mode: str,
    divisor: float | None = None,
    *,
    cliprange: float,
    lr: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Every parameter's SGD update by the critic's value loss in ``mode``:
    ``l[i,t] = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, weighed by
    the mode's formula over the active responses."""
    assert batch.values is not None
    assert batch.returns is not None
    model = Qwen2ForTokenClassification.from_pretrained(value_dir, attn_implementation="eager")
    model.float()
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids
    ).logits.squeeze(-1)  # [B, P + R]
    # The value of response token t is read where the log-probability is: one step left.
    vpred = out[:, tiny_verl.PROMPT_LEN - 1 : -1].float()  # [B, R]
    clipped = torch.maximum(
        torch.minimum(vpred, batch.values + cliprange), batch.values - cliprange
    )
    loss_t = 0.5 * torch.maximum((vpred - batch.returns) ** 2, (clipped - batch.returns) ** 2)
    mask = batch.response_mask.bool()
    loss_t = torch.where(mask, loss_t, 0.0)
    d = mask.sum(-1).double()  # [B] D_i
    active = d > 0
    row = loss_t.sum(-1).double()  # [B]
    if mode == "token_mean":
        loss = row.sum() / d.sum()
    elif mode == "seq_mean":
        loss = (row[active] / d[active]).sum() / active.sum()
    elif mode == "constant":
        assert divisor is not None
        loss = row.sum() / (divisor * active.sum())
    else:
        total, groups = torch.zeros((), dtype=torch.float64), 0
        for g in sorted(set(batch.uid)):
            in_g = torch.tensor([u == g for u in batch.uid])
            if d[in_g].sum() > 0:
                total = total + row[in_g].sum() / d[in_g].sum()
                groups += 1
        loss = total / groups
    loss.backward()
    return {n: -lr * p.grad for n, p in model.named_parameters() if p.grad is not None}


def clip_cov_draw(
    model_dir: Path, batch: tiny_verl.Rows, config: Any, job: str, step: int = 0
) -> torch.Tensor:
    """``[B, R]`` bool: the tokens ``clip_cov`` draws over the whole mini-batch by the rule
    of the reduction semantics, recomputed here: the exact means of the advantages and
    current log-probabilities over the active tokens, each token's covariance, the
    candidates (in ``(clip_cov_lb, clip_cov_ub)``, not clipped by PPO), and the
    ``max(1, int(clip_cov_ratio * N))`` candidates of smallest key, each key drawn from
    (the job as configured, without any run id; ``config.data_loader_seed``; the round;
    the row's identity from its tokens, :func:`row_identity`; the position)."""
    from fractions import Fraction

    from lossreduce.trainer_worker.token_stats import draw_keys, seed_of

    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float()
    with torch.no_grad():
        lp, _ = tiny_verl._log_probs(model, batch)
    mask = batch.response_mask.bool()

    def exact_mean(values: torch.Tensor) -> torch.Tensor:
        mean = sum(Fraction(float(v)) for v in values.tolist()) / values.numel()
        return torch.tensor(float(mean), dtype=torch.float32)

    adv = torch.where(mask, batch.advantages, 0.0)
    cov = (adv - exact_mean(adv[mask])) * (lp - exact_mean(lp[mask]))
    policy = config.policy_loss
    ratio = torch.exp(lp - torch.where(mask, batch.old_log_probs, 0.0))
    clipped = -adv * ratio.clamp(1 - config.clip_ratio, 1 + config.clip_ratio) > -adv * ratio
    candidates = mask & ~clipped & (cov > policy.clip_cov_lb) & (cov < policy.clip_cov_ub)
    k = max(int(policy.clip_cov_ratio * int(mask.sum())), 1)
    rows = [
        row_identity(batch.input_ids[i][batch.attention_mask[i].bool()].tolist())
        for i in range(batch.size)
    ]
    keys = draw_keys(
        seed_of("clip_cov", job, config.data_loader_seed, step),
        torch.tensor(rows, dtype=torch.int64)[:, None],
        torch.arange(mask.shape[1])[None, :],
    )
    drawn = torch.zeros(mask.shape, dtype=torch.bool)
    for _, i, t in sorted((int(keys[i, t]), i, t) for i, t in torch.nonzero(candidates).tolist())[
        :k
    ]:
        drawn[i, t] = True
    return drawn


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer of ``x + golden`` on Python integers modulo ``2**64``."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_identity(tokens: list[int]) -> int:
    """A row's identity as the draw keys it, from its tokens (prompt and response, no
    padding): ``mix64(L ^ sum_t mix64(mix64(t) ^ x[t]))`` modulo ``2**64``, written here on
    Python integers, as a signed int64."""
    total = sum(_mix64(_mix64(t) ^ x) for t, x in enumerate(tokens)) & _MASK64
    value = _mix64(len(tokens) ^ total)
    return value - (1 << 64) if value >> 63 else value
