"""verl 0.9.1's registered policy losses, and what lossreduce does with each.

verl registers twelve policy losses (``@register_policy_loss`` in
``verl/trainer/ppo/core_algos.py``). lossreduce keeps each one's per-token (or,
for ``geo_mean``, per-response) loss, computed by verl's own function, and
replaces only its aggregation: the sum over the mini-batch's responses is
divided by the global normalizer of lossreduce's mode instead of verl's
``loss_agg_mode`` denominators.

Two questions decide how a loss fits:

- **What one unit of loss is.** Most losses give a loss per token ``l[i,t]``,
  so every mode of ``docs/reduction-semantics.md`` applies: the row weights of
  :mod:`.plan` enter through verl's ``rollout_is_weights`` argument, by which
  each of these losses multiplies its per-token loss. ``geo_mean`` (GMPO) gives
  one loss per response, ``-A_i * r_i`` with ``r_i`` the geometric mean of the
  clipped token ratios; a response has no tokens to weigh, so only ``seq_mean``
  (every response weighs the same, GMPO's mean over responses) has a meaning.
  ``sapo`` gives a loss per token, but verl defines its objective with the
  ``seq-mean-token-mean`` aggregation whatever ``loss_agg_mode`` says; only
  ``seq_mean`` is that objective.
- **Whether it takes a statistic over the call.** ``clip_cov`` and ``kl_cov``
  centre advantages and log-probabilities on their mean over the call's tokens
  and select tokens by that covariance (a seeded draw, a top share);
  ``bypass_mode`` can normalize its importance weights to mean 1 over the call.
  Taken per micro-batch, as verl does, the update depends on the split; lossreduce
  takes them over the whole mini-batch (:mod:`.statistics`), or per call when
  asked (``statistics='per_call'``).

This module imports no verl: the launch check and the unit tests read it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = [
    "ALL_MODES",
    "POLICY_LOSSES",
    "VERL_FALLBACKS",
    "LossUnit",
    "Statistic",
    "VerlPolicyLoss",
    "policy_loss",
    "policy_option",
]

ALL_MODES = frozenset(PolicyGradientMode)


class LossUnit(Enum):
    """What verl's function returns a loss for."""

    TOKEN = "token"
    """``l[i,t]``, multiplied by ``rollout_is_weights`` before verl aggregates it."""
    SEQUENCE = "sequence"
    """``L_i``, one per response, averaged over the call's rows."""


class Statistic(Enum):
    """A statistic a loss takes over the tokens of its call."""

    NONE = "none"
    COVARIANCE = "covariance"
    """``(A - mean A)(log p - mean log p)`` over the active tokens, from the current
    log-probabilities, and a selection of tokens by it."""
    IMPORTANCE_MEAN = "importance_mean"
    """The mean importance weight (``rollout_correction.rollout_is_batch_normalize``),
    from the current log-probabilities."""


@dataclass(frozen=True)
class VerlPolicyLoss:
    """One of verl's registered policy losses, as lossreduce runs it."""

    name: str
    unit: LossUnit
    modes: frozenset[PolicyGradientMode]
    """The lossreduce modes that have a meaning for this loss."""
    why: str
    """What the loss is, and why modes outside :attr:`modes` have no meaning."""
    statistic: Statistic = Statistic.NONE
    sequence_ratio: bool = False
    """The importance ratio is one per response (``gspo``): every mode weighs tokens
    whose ratio is their response's."""

    def mode_problem(self, mode: PolicyGradientMode) -> str | None:
        """Why ``mode`` has no meaning for this loss, or None when it has."""
        if mode in self.modes:
            return None
        allowed = ", ".join(sorted(m.value for m in self.modes))
        return (
            f"actor.policy_loss.loss_mode={self.name!r} with lossreduce mode "
            f"{mode.value!r}: {self.why}; set mode to {allowed}"
        )


_TOKEN = "a loss per token, multiplied by rollout_is_weights before verl aggregates it"

POLICY_LOSSES: dict[str, VerlPolicyLoss] = {
    loss.name: loss
    for loss in (
        VerlPolicyLoss("vanilla", LossUnit.TOKEN, ALL_MODES, f"dual-clip PPO, {_TOKEN}"),
        VerlPolicyLoss("dppo_tv", LossUnit.TOKEN, ALL_MODES, f"DPPO-Binary-TV, {_TOKEN}"),
        VerlPolicyLoss("dppo_kl", LossUnit.TOKEN, ALL_MODES, f"DPPO-Binary-KL, {_TOKEN}"),
        VerlPolicyLoss(
            "gspo",
            LossUnit.TOKEN,
            ALL_MODES,
            "a loss per token whose ratio is its response's length-normalized sequence "
            "ratio; seq_mean is GSPO's own aggregation, token_mean verl's default for it",
            sequence_ratio=True,
        ),
        VerlPolicyLoss(
            "sapo",
            LossUnit.TOKEN,
            frozenset({PolicyGradientMode.SEQ_MEAN}),
            "verl defines SAPO's objective as the mean over responses of each response's "
            "token mean (seq-mean-token-mean, whatever loss_agg_mode says); another mode "
            "would weigh responses by their length and train another objective",
        ),
        VerlPolicyLoss("gpg", LossUnit.TOKEN, ALL_MODES, f"GPG, {_TOKEN}"),
        VerlPolicyLoss(
            "clip_cov",
            LossUnit.TOKEN,
            ALL_MODES,
            f"Clip-Cov, {_TOKEN}, with a draw of tokens by covariance",
            statistic=Statistic.COVARIANCE,
        ),
        VerlPolicyLoss(
            "kl_cov",
            LossUnit.TOKEN,
            ALL_MODES,
            f"KL-Cov, {_TOKEN}, with a KL penalty on the tokens of largest covariance",
            statistic=Statistic.COVARIANCE,
        ),
        VerlPolicyLoss(
            "geo_mean",
            LossUnit.SEQUENCE,
            frozenset({PolicyGradientMode.SEQ_MEAN}),
            "GMPO gives one loss per response (-A_i * r_i, r_i the geometric mean of the "
            "clipped token ratios), not per token, so there are no tokens to weigh or count: "
            "only the mean over responses has a meaning",
            sequence_ratio=True,
        ),
        VerlPolicyLoss("dro", LossUnit.TOKEN, ALL_MODES, f"DRO, {_TOKEN}"),
        VerlPolicyLoss("cispo", LossUnit.TOKEN, ALL_MODES, f"CISPO, {_TOKEN}"),
        VerlPolicyLoss(
            "bypass_mode",
            LossUnit.TOKEN,
            ALL_MODES,
            "rollout correction in bypass mode: PPO-clip or REINFORCE against the rollout "
            "policy, a loss per token",
            statistic=Statistic.IMPORTANCE_MEAN,
        ),
    )
}
"""Every policy loss verl 0.9.1 registers, by ``actor.policy_loss.loss_mode``."""


VERL_FALLBACKS: dict[str, float] = {
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 1.0,
}
"""What verl's loss functions take when an option of ``actor.policy_loss`` is None."""


def policy_option(policy: Any, name: str) -> float:
    """``actor.policy_loss.<name>`` as verl's loss function reads it (None: its fallback)."""
    value = policy.get(name, None)
    return VERL_FALLBACKS[name] if value is None else float(value)


def policy_loss(name: str) -> VerlPolicyLoss | None:
    """The loss registered as ``name`` in verl 0.9.1, or None for one lossreduce does not
    know (a loss registered by the user, whose loss need not be linear in
    ``rollout_is_weights``, lossreduce's row-weight seam)."""
    return POLICY_LOSSES.get(name)
