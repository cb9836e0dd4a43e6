"""GRPO pieces: group-relative advantages, the PPO-clipped token loss, the
KL-to-reference penalty.

All pure tensor functions; how the token losses are normalized (per token,
sequence, prompt group or constant) is the reduction library's job, not this
module's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lossreduce.trainer_worker.policy_gradient import (
    PolicyGradientMode,
    PolicyGradientReduction,
    zero_masked,
)
from lossreduce.trainer_worker.reduction import Batch, LossReduction
from lossreduce.trainer_worker.train.rollouts import response_logprobs

__all__ = [
    "KL_TERM",
    "PG_TERM",
    "GRPOLoss",
    "kl_penalty",
    "ppo_clip_loss",
]

PG_TERM = "pg"
"""Name of the policy-gradient term."""
KL_TERM = "kl"
"""Name of the KL-to-reference term (present when its coefficient is > 0)."""


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
) -> torch.Tensor:
    """Per-token PPO-clipped policy-gradient loss.

    ``logprobs``/``old_logprobs`` are ``[N, L]``, ``advantages`` ``[N]``;
    returns ``[N, L]``: ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``.
    Callers zero masked positions in the inputs first, so padding cannot
    produce a NaN that reaches the gradient.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [N, L]
    adv = advantages.unsqueeze(1)  # [N, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    return -torch.minimum(unclipped, clipped)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) by the k3 estimator, ``[N, L]``.

    ``exp(ref - logp) - (ref - logp) - 1`` is non-negative and unbiased for
    samples drawn from the policy (Schulman's "Approximating KL divergence").
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


class GRPOLoss:
    """The GRPO loss as a :class:`LossReduction` for the engine.

    Terms: ``pg``, the PPO-clipped token loss reduced by ``mode`` (its
    normalizer counts tokens, sequences or prompt groups), and — when
    ``kl_coef > 0`` — ``kl``, ``kl_coef`` times the k3 KL to the reference
    with its own ``token_mean`` normalizer (folding it into a non-token ``pg``
    term would weigh it by response length).

    Microbatches hold ``tokens`` ``[N, P + L]``, ``loss_mask``,
    ``old_logprobs``, ``ref_logprobs`` ``[N, L]``, ``advantages`` ``[N]`` and
    ``group_sizes`` ``[G]``; the model output handed to the loss is the
    response log-probs ``[N, L]`` (:meth:`forward`) at the sampling
    ``temperature``, the one ``old_logprobs`` and ``ref_logprobs`` were taken
    at, so the PPO ratio of the unchanged policy is exactly 1.
    """

    def __init__(
        self,
        mode: PolicyGradientMode,
        *,
        divisor: float | None,
        kl_coef: float,
        clip_eps: float,
        prompt_len: int,
        temperature: float = 1.0,
    ) -> None:
        self.pg = PolicyGradientReduction(mode, divisor)
        self.kl = PolicyGradientReduction("token_mean") if kl_coef > 0 else None
        self.kl_coef = kl_coef
        self.clip_eps = clip_eps
        self.prompt_len = prompt_len
        self.temperature = temperature
        terms = [self.pg.term(PG_TERM)]
        if self.kl is not None:
            terms.append(self.kl.term(KL_TERM))
        self.reduction = LossReduction(self.loss, terms)

    def forward(self, model: nn.Module, microbatch: Batch) -> Tensor:
        """The engine's ``forward_fn``: response log-probs ``[N, L]`` at the sampling temperature."""
        return response_logprobs(model, microbatch["tokens"], self.prompt_len, self.temperature)

    def loss(self, logprobs: Tensor, microbatch: Batch) -> Mapping[str, Tensor]:
        """Every term's local mean for one microbatch."""
        mask = microbatch["loss_mask"]  # [N, L]
        # Zero the inputs at padding so nothing non-finite there reaches a gradient.
        logp = zero_masked(logprobs, mask)
        old = zero_masked(microbatch["old_logprobs"], mask)
        token_loss = ppo_clip_loss(logp, old, microbatch["advantages"], self.clip_eps)  # [N, L]
        out = {PG_TERM: self.pg.aggregate(token_loss, mask, group_sizes=microbatch["group_sizes"])}
        if self.kl is not None:
            ref = zero_masked(microbatch["ref_logprobs"], mask)
            out[KL_TERM] = self.kl_coef * self.kl.aggregate(kl_penalty(logp, ref), mask)
        return out
