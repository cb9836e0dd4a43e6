"""The statistics ``clip_cov``, ``kl_cov`` and ``bypass_mode`` take per call, over the whole mini-batch.

verl computes them inside the loss, over the tokens of one micro-batch call, so
which tokens are drawn or penalized and how importance weights are scaled depend
on how the mini-batch is split into ranks and micro-batches. With
``statistics='mini_batch'`` the worker instead runs a no-grad forward of its
mini-batch share first (the statistics need the *current* log-probabilities) and
reduces, over the active tokens of every rank:

- ``clip_cov`` and ``kl_cov``: the exact means of the advantages and of the
  log-probabilities (:func:`~lossreduce.trainer_worker.token_stats.global_exact_sums`),
  so each token's covariance ``(A - mean A)(log p - mean log p)`` is the same in
  every layout. ``kl_cov`` then penalizes the ``max(1, int(kl_cov_ratio * N))``
  tokens of largest covariance, ties kept together (a value-based global order
  statistic); ``clip_cov`` draws ``max(1, int(clip_cov_ratio * N))`` of its
  candidates (tokens in ``(clip_cov_lb, clip_cov_ub)`` that PPO's clip has not
  clipped) by keys of :func:`clip_cov_seed` and each token's identity (its row's,
  :func:`row_identities`, from the row's tokens; its position), so every layout
  draws the same tokens (``N``: the mini-batch's active tokens), and so does a
  rerun of the same config and a resumed run: nothing in the key is drawn anew by
  a launch or depends on the order in which verl's rollout returned the rows.
- ``bypass_mode`` with ``rollout_is_batch_normalize``: the exact mean importance
  weight (per active token, or per active response for sequence-level weights).

Everything is reduced through a normalizer backend of the worker's own (group
``<group>.stats``), in rounds numbered ``2 * round + phase`` there, so a NaN on one
rank stops every rank with the same error, and nothing is all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lossreduce.trainer_worker.integrations.verl.policy_losses import (
    Statistic,
    VerlPolicyLoss,
    policy_option,
)
from lossreduce.trainer_worker.normalizers import GlobalNormalizer
from lossreduce.trainer_worker.token_stats import (
    draw_keys,
    float_order_keys,
    global_exact_sums,
    global_kth_smallest,
    seed_of,
)
from lossreduce.trainer_worker.token_stats.keys import mix64

__all__ = [
    "MiniBatchStatistics",
    "StatsPlace",
    "clip_cov_seed",
    "covariance_selection",
    "mini_batch_importance_mean",
    "row_identities",
]


@dataclass(frozen=True)
class StatsPlace:
    """Where one mini-batch's statistics reduce: a backend of their own, this rank's place."""

    normalizer: GlobalNormalizer
    step: int
    """The mini-batch's round; the statistics use ``2 * step`` and ``2 * step + 1``."""
    rank: int
    world_size: int
    job: str
    group: str

    def phase(self, index: int) -> dict[str, Any]:
        return {
            "normalizer": self.normalizer,
            "step": 2 * self.step + index,
            "rank": self.rank,
            "world_size": self.world_size,
            "job": self.job,
            "group": self.group,
        }


@dataclass(frozen=True)
class MiniBatchStatistics:
    """What a mini-batch's statistic decided, for this rank's rows."""

    selected: Tensor | None = None
    """``[B, R]`` float, 1 at the tokens ``clip_cov`` drew or ``kl_cov`` penalizes."""
    importance_mean: float | None = None
    """``bypass_mode``'s mean importance weight over the mini-batch (None: not normalized)."""
    metrics: dict[str, float] | None = None


def clip_cov_seed(job: str, loader_seed: int | None, step: int) -> int:
    """The seed of ``clip_cov``'s draw in mini-batch round ``step``: the job as configured
    (``job``: the user's, or the framework's default *without* the run id a launch draws),
    verl's ``actor.data_loader_seed`` (``loader_seed``; None where the config has none)
    and the round, which verl's checkpoint restores on resume. A rerun of the same config
    and a run resumed from a checkpoint draw what the first (uninterrupted) run drew; a
    different seed or job draws anew."""
    seed: str | int = "unset" if loader_seed is None else loader_seed
    return seed_of("clip_cov", job, seed, step)


def row_identities(tokens: Tensor, offsets: Tensor) -> Tensor:
    """``[B]`` int64: each row's identity, from its tokens alone (prompt and response,
    no padding): ``mix64(L_i ^ sum_t mix64(mix64(t) ^ x_i[t]))`` (wrapping int64), for
    row ``i``'s ``L_i`` tokens ``x_i``. The same sequence has the same identity in any
    run, layout, order or mini-batch, so ``clip_cov``'s draw does not depend on the order
    in which verl's rollout returned the rows (which varies from run to run); two equal
    sequences (the same response to the same prompt) share it, and each of their tokens
    is drawn or left with its twin.

    ``tokens``: ``[total]`` the rows' tokens one after another (a nested tensor's
    ``values()``); ``offsets``: ``[B + 1]`` where each row starts, then the end."""
    lengths = offsets.diff()  # [B]
    rows = lengths.shape[0]
    row = torch.repeat_interleave(torch.arange(rows, device=offsets.device), lengths)  # [total]
    position = torch.arange(tokens.shape[0], device=offsets.device) - offsets[:-1][row]
    mixed = mix64(mix64(position) ^ tokens.to(torch.int64))  # [total]
    sums = torch.zeros(rows, dtype=torch.int64, device=offsets.device).index_add_(0, row, mixed)
    return mix64(lengths.to(torch.int64) ^ sums)


def covariance_selection(
    loss: VerlPolicyLoss,
    config: Any,
    place: StatsPlace,
    *,
    advantages: Tensor,
    log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    row_ids: Tensor,
    draw_seed: int,
) -> MiniBatchStatistics:
    """The tokens ``clip_cov`` draws or ``kl_cov`` penalizes, over the whole mini-batch.

    ``advantages``, ``log_prob`` (current), ``old_log_prob``, ``mask``: ``[B, R]`` of this
    rank's rows, inputs zeroed under the mask; ``row_ids``: ``[B]`` int64 each row's
    identity (:func:`row_identities`); ``draw_seed``: ``clip_cov``'s
    (:func:`clip_cov_seed`; ``kl_cov`` draws nothing). Collective: every rank calls it.
    """
    assert loss.statistic is Statistic.COVARIANCE
    mask = mask.bool()
    sums = global_exact_sums(
        {"advantages": advantages[mask], "log_prob": log_prob[mask]}, **place.phase(0)
    )
    active = sums["advantages"].count
    if active == 0:
        return MiniBatchStatistics(selected=torch.zeros(mask.shape), metrics={})
    dtype = log_prob.dtype
    mean_a = torch.tensor(sums["advantages"].mean, dtype=dtype)
    mean_lp = torch.tensor(sums["log_prob"].mean, dtype=dtype)
    cov = (advantages.to(dtype) - mean_a) * (log_prob - mean_lp)  # [B, R]
    policy = config.policy_loss
    if loss.name == "kl_cov":
        share = int(active * policy_option(policy, "kl_cov_ratio"))
        keys = float_order_keys(-cov.to(torch.float64))  # largest covariance first
        chosen = mask
    else:
        share = int(active * policy_option(policy, "clip_cov_ratio"))
        chosen = mask & ~_clipped(config, advantages.to(dtype), log_prob, old_log_prob.to(dtype))
        chosen &= (cov > policy_option(policy, "clip_cov_lb")) & (
            cov < policy_option(policy, "clip_cov_ub")
        )
        positions = torch.arange(mask.shape[1], dtype=torch.int64)
        keys = draw_keys(draw_seed, row_ids.to(torch.int64)[:, None], positions[None, :])  # [B, R]
    kth = global_kth_smallest(keys[chosen], max(share, 1), **place.phase(1))
    selected = (chosen & kth.select(keys)).to(torch.float32)
    return MiniBatchStatistics(
        selected=selected,
        metrics={
            "lossreduce/stats/selected": float(kth.selected),
            "lossreduce/stats/candidates": float(kth.total),
            "lossreduce/stats/active_tokens": float(active),
        },
    )


def _clipped(config: Any, advantages: Tensor, log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """Where PPO's clip already took the clipped branch (``clip_cov``'s ``clip_by_origin``)."""
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    return clipped > unclipped


def mini_batch_importance_mean(
    correction: Any,
    place: StatsPlace,
    *,
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    mask: Tensor,
) -> MiniBatchStatistics:
    """``bypass_mode``'s mean importance weight over the whole mini-batch (verl's
    ``rollout_is_batch_normalize``, which verl takes per call): over the active tokens
    for token-level weights, over the active responses for sequence-level ones."""
    mask = mask.bool()
    level = correction.get("rollout_is", None)
    if level is None:
        return MiniBatchStatistics()
    if not bool(mask.any()):
        # verl's helper raises on a share without an active token; this rank has no
        # weight to add, and still takes part in the round.
        values = torch.zeros(0, dtype=log_prob.dtype)
    else:
        values = _importance_values(correction, level, log_prob, rollout_log_prob, mask)
    sums = global_exact_sums({"importance": values}, **place.phase(0))
    mean = sums["importance"].mean
    return MiniBatchStatistics(
        importance_mean=mean,
        metrics={} if mean is None else {"lossreduce/stats/importance_mean": float(mean)},
    )


def _importance_values(
    correction: Any, level: str, log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor
) -> Tensor:
    """This rank's truncated importance weights, one per active token (token level) or
    per active response (sequence level), as verl's helper computes them."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights, _ = compute_rollout_correction_weights(
        log_ratio=log_prob - rollout_log_prob,
        response_mask=mask,
        rollout_is=level,
        rollout_is_threshold=correction.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=False,
    )  # [B, R], 0 where masked
    if level == "sequence":
        # One weight per response, the same at each of its tokens: its first active one.
        active = mask.any(-1)  # [B]
        first = mask.to(torch.int64).argmax(-1)  # [B]
        return weights.gather(-1, first[:, None]).squeeze(-1)[active]  # type: ignore[no-any-return]
    return weights[mask]  # type: ignore[no-any-return]
