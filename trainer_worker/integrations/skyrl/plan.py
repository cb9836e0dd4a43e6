"""One SkyRL mini-batch's terms, row weights and the micro-batch shares: pure torch.

SkyRL's policy worker receives each data-parallel rank's share of a mini-batch (one
optimizer step) in ``forward_backward`` and splits it into micro-batches itself, by
count or by token budget. Nothing that depends on that split may enter the loss, so
the whole share is planned once, before it, and every term is written as a sum over
its rows (``D_i`` = tokens of row ``i`` under SkyRL's ``loss_mask``):

    term = (sum over rows i of w_i * sum_t x[i,t] * m[i,t]) / N

with the weights and partials of :func:`lossreduce.trainer_worker.step_rows.plan_terms`
(``token_mean``: ``w_i = 1``; ``seq_mean``: ``1 / D_i``; ``prompt_mean``: ``1 / D_g``
of the row's prompt group over every rank; ``constant``: ``1 / C``), each term in its
own mode:

- ``pg``: SkyRL's registered policy loss. It returns ``sum l[i,t] * m[i,t]`` of per-token
  losses positively homogeneous in the advantage, so the row's scale ``w_i / N`` enters
  through the advantages, as SkyRL's own driver pre-scales them;
- ``kl``: SkyRL's ``compute_approx_kl`` against the reference policy;
- ``entropy``: the policy's token entropy (a bonus: subtracted);
- ``vf``: the critic's value loss (:func:`value_token_loss`, SkyRL's ``ppo_critic_loss``
  per token), in a critic mini-batch of its own.

A row without active tokens has weight 0 and is counted nowhere. :func:`z_score` is the
driver's ``advantage_batch_normalize`` over the active tokens. No SkyRL, gRPC or
process group here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction, zero_masked
from lossreduce.trainer_worker.step_rows import TermPlan

__all__ = [
    "ENTROPY_TERM",
    "KL_TERM",
    "POLICY_TERM",
    "PROMPT_FIELD",
    "VALUE_SCALE_FIELD",
    "VALUE_TERM",
    "WEIGHT_FIELDS",
    "prompt_ids",
    "row_scales",
    "term_reductions",
    "token_share",
    "value_token_loss",
    "z_score",
]

POLICY_TERM = "pg"
KL_TERM = "kl"
ENTROPY_TERM = "entropy"
VALUE_TERM = "vf"

PROMPT_FIELD = "lossreduce_prompt"
"""The batch field (``[B]`` int64) the trainer adds: each row's prompt group, numbered
over the whole training batch. SkyRL's dispatch hands each rank a chunk of rows with
the whole batch's metadata, so the group must travel with the rows."""
WEIGHT_FIELDS: dict[str, str] = {
    KL_TERM: "lossreduce_kl_scale",
    ENTROPY_TERM: "lossreduce_entropy_scale",
}
"""Batch fields (``[B]`` float64) the worker adds for the micro-batches: each row's
``w_i / N`` of a term other than the policy loss (whose scale is in the advantages)."""
VALUE_SCALE_FIELD = "lossreduce_vf_scale"
"""The batch field (``[B]`` float64) the critic worker adds: each row's ``w_i / N`` of
the value loss."""


def term_reductions(
    policy: PolicyGradientReduction,
    kl: PolicyGradientReduction | None,
    entropy: PolicyGradientReduction | None,
) -> dict[str, PolicyGradientReduction]:
    """The terms of one mini-batch and their reductions; a term that is off is None."""
    terms = {POLICY_TERM: policy}
    if kl is not None:
        terms[KL_TERM] = kl
    if entropy is not None:
        terms[ENTROPY_TERM] = entropy
    return terms


def prompt_ids(prompt_boundaries: list[tuple[int, int]], batch_size: int) -> Tensor:
    """Each row's prompt group (``[B]`` int64) from SkyRL's ``policy_prompt_boundaries``;
    rows past the last boundary (SkyRL's padding rows) get groups of their own."""
    ids = torch.empty(batch_size, dtype=torch.long)
    covered = torch.zeros(batch_size, dtype=torch.bool)
    for group, (start, end) in enumerate(prompt_boundaries):
        ids[start:end] = group
        covered[start:end] = True
    rest = (~covered).nonzero().flatten()
    ids[rest] = len(prompt_boundaries) + torch.arange(rest.numel())
    return ids


def row_scales(plan: TermPlan, totals: Mapping[str, float]) -> dict[str, Tensor]:
    """Each term's ``w_i / N`` of this rank's rows (``[B]`` float64)."""
    return {term: weights / totals[term] for term, weights in plan.weights.items()}


def token_share(values: Tensor, mask: Tensor, scale: Tensor) -> Tensor:
    """One micro-batch's share of a term: ``sum_i scale_i * sum_t x[i,t] * m[i,t]``.

    ``values`` and ``mask`` are ``[B, T]``, ``scale`` ``[B]`` (``w_i / N``); ``values``
    is zeroed under the mask before any arithmetic, so a NaN there stays out of the
    gradient."""
    per_row = (zero_masked(values, mask) * mask).sum(-1)  # [B]
    return (per_row * scale.to(per_row.dtype)).sum()


def value_token_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None
) -> Tensor:
    """SkyRL's ``ppo_critic_loss`` before its reduction (``[B, T]``):
    ``0.5 * max((clip(V) - R)^2, (V - R)^2)`` with ``clip(V) = V_old + clamp(V - V_old,
    -value_clip, value_clip)``, or ``0.5 * (V - R)^2`` without ``value_clip``. SkyRL's
    loss is the mean over a micro-batch's rows of each row's token mean of this."""
    if value_clip is None:
        return 0.5 * (values - returns) ** 2
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return 0.5 * torch.max((clipped - returns) ** 2, (values - returns) ** 2)


def z_score(advantages: Tensor, mask: Tensor) -> Tensor:
    """SkyRL's ``advantage_batch_normalize`` with its statistics over active tokens only:
    ``(A - mu) / max(sigma, 1e-4)`` with ``mu`` and ``sigma^2`` the mean and variance of
    ``A`` over the tokens where ``mask`` (the loss mask) is set and ``A`` is finite,
    summed in float64. ``advantages`` and ``mask`` are ``[B, T]``, the whole training
    batch (the driver's, so every rank gets the same numbers).

    SkyRL centres on the mean of *every* entry (padding and masked tokens too) and scales
    by the deviation over the response tokens, so one NaN under the mask turns every
    advantage NaN. Here a masked entry, NaN or not, moves nothing; a non-finite active
    token stays non-finite (NaN, or inf of its sign) and leaves every other token finite,
    so the worker's check names its row alone. Without a counted token the advantages
    are returned as they are (the mini-batch is then empty, or refused for its
    non-finite tokens)."""
    counted = (mask != 0) & torch.isfinite(advantages)  # [B, T]
    n = int(counted.sum())
    if n == 0:
        return advantages
    wide = advantages.to(torch.float64)
    mean = torch.where(counted, wide, 0.0).sum() / n
    variance = torch.where(counted, wide - mean, 0.0).pow(2).sum() / n
    return ((wide - mean) * variance.clamp(min=1e-8).rsqrt()).to(advantages.dtype)
