"""One SkyRL policy mini-batch's terms, row weights and the micro-batch shares: pure torch.

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
- ``entropy``: the policy's token entropy (a bonus: subtracted).

A row without active tokens has weight 0 and is counted nowhere. No SkyRL, gRPC or
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
    "WEIGHT_FIELDS",
    "prompt_ids",
    "row_scales",
    "term_reductions",
    "token_share",
]

POLICY_TERM = "pg"
KL_TERM = "kl"
ENTROPY_TERM = "entropy"

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
