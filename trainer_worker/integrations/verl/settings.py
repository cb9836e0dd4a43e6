"""How :class:`~lossreduce.trainer_worker.integrations.verl.LossReduceTrainingWorker`
normalizes verl's actor loss, and
:class:`~lossreduce.trainer_worker.integrations.verl.LossReduceCriticWorker` the
critic's: :class:`VerlReductionSettings`, every field described.

Fields read ``LOSSREDUCE_*`` environment variables unless given explicitly;
verl starts its workers as Ray actors, which inherit the driver's environment
through Ray's runtime env. This module does not import verl.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from lossreduce.trainer_worker.integrations.settings import (
    ReductionSettings,
    group_field,
    job_field,
    ray_coordinator_field,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["StatisticsScope", "VerlReductionSettings"]

StatisticsScope = Literal["mini_batch", "per_call"]


class VerlReductionSettings(ReductionSettings):
    """The reduction a verl actor (and critic) uses instead of its ``loss_agg_mode``
    normalization.

    One optimizer step is one PPO mini-batch; ``prompt_mean`` groups responses by
    verl's prompt ``uid``. With ``on_empty_step='skip'`` an empty mini-batch runs no
    forward either (verl's own run would decay every weight and count a step).
    """

    joins_ray_coordinator: ClassVar[bool] = True

    coordinator: str | None = ray_coordinator_field("the ranks")
    job: str = job_field("verl-ppo")
    group: str = group_field("actor", "Reduction group of the actor's rounds within the job.")
    statistics: StatisticsScope = Field(
        default="mini_batch",
        description=(
            "Where the statistics that verl's clip_cov, kl_cov and bypass_mode policy losses "
            "take over the tokens of one call are taken: 'mini_batch' (over the whole PPO "
            "mini-batch, every rank and micro-batch, exact and the same however verl splits "
            "it; clip_cov, kl_cov and a normalized bypass_mode run a no-grad forward of the "
            "mini-batch first) or 'per_call' (verl's own: over each micro-batch, so the "
            "update depends on the split)."
        ),
    )
    reuse_old_log_prob: bool = Field(
        default=True,
        description=(
            "With statistics='mini_batch': on the first mini-batch of a training step's first "
            "epoch, when the lossreduce trainer mode says the actor recomputed old_log_prob "
            "for this update (verl's default; not in rollout correction's bypass mode), take "
            "the statistics from old_log_prob, which the same weights computed, instead of a "
            "no-grad forward (on CPU in float32 the two are bit for bit the same). False: "
            "the forward on every mini-batch."
        ),
    )
    critic_mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            "What the critic's value loss (verl's clipped value loss, with "
            "algorithm.adv_estimator=gae) weighs equally over one critic mini-batch: "
            "token_mean (verl's default), seq_mean, prompt_mean or constant."
        ),
    )
    critic_divisor: float | None = Field(
        default=None,
        description="The length budget C of critic_mode 'constant'; only valid with it.",
    )
    critic_group: str = group_field(
        "critic", "Reduction group of the critic's rounds within the job."
    )

    @property
    def critic_reduction(self) -> PolicyGradientReduction:
        """The value loss's reduction these settings describe."""
        return PolicyGradientReduction(self.critic_mode, self.critic_divisor)

    @model_validator(mode="after")
    def _critic_consistent(self) -> VerlReductionSettings:
        try:
            _ = self.critic_reduction  # the mode/divisor rules, as for the actor
        except ValueError as err:
            raise ValueError(
                f"critic_mode={self.critic_mode.value!r}, critic_divisor={self.critic_divisor!r}: "
                f"{err}"
            ) from None
        if self.critic_group == self.group:
            raise ValueError(
                f"critic_group={self.critic_group!r} equals group: the actor's and the "
                "critic's rounds need groups of their own"
            )
        return self
