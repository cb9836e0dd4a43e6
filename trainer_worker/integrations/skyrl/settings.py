"""How SkyRL's policy worker is normalized by lossreduce: :class:`SkyRLReductionSettings`.

A launch gives the settings under ``trainer.lossreduce`` (``trainer.lossreduce.mode=
prompt_mean``); fields it does not give read ``LOSSREDUCE_*`` environment variables.
SkyRL hands its workers the trainer config, so every policy worker reads the same
block. This module does not import SkyRL.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from lossreduce.trainer_worker.integrations.settings import (
    ReductionSettings,
    group_field,
    job_field,
    ray_coordinator_field,
)
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["SkyRLReductionSettings"]


def _term_mode(term: str) -> PolicyGradientMode:
    return Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            f"What SkyRL's {term} term weighs equally over one mini-batch, as a term of its "
            "own with its own global normalizer: token_mean (every active token, the "
            "default), seq_mean (every active response), prompt_mean (every active prompt "
            "group) or constant (sum over tokens / (divisor x active responses))."
        ),
    )


class SkyRLReductionSettings(ReductionSettings):
    """The reduction SkyRL's policy and critic workers use instead of SkyRL's divisions.

    One optimizer step is one policy mini-batch (``trainer.policy_mini_batch_size``
    prompts), or one critic mini-batch (``trainer.critic_mini_batch_size``). ``mode``
    is the policy loss's reduction; ``kl_mode`` and ``entropy_mode`` are those of
    SkyRL's KL loss (``algorithm.use_kl_loss``) and entropy loss
    (``algorithm.use_entropy_loss``), each a term of its own; ``critic_mode`` is the
    critic's value loss's (term ``vf``, reduced in ``critic_group``); ``divisor`` is
    ``constant``'s length budget for every term in that mode. With
    ``on_empty_step='skip'`` an empty mini-batch runs no forward, backward or
    optimizer step on any rank.
    """

    joins_ray_coordinator: ClassVar[bool] = True

    coordinator: str | None = ray_coordinator_field("the policy workers")
    kl_mode: PolicyGradientMode = _term_mode("KL")
    entropy_mode: PolicyGradientMode = _term_mode("entropy")
    job: str = job_field("skyrl-ppo")
    group: str = group_field(
        "policy",
        "Reduction group of the policy's rounds within the job. With Ulysses sequence "
        "parallelism each sequence-parallel index reduces over the data-parallel ranks in "
        "its own group '<group>.sp<index>'.",
    )
    critic_mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            "What the critic's value loss (SkyRL's ppo_critic_loss per token, with a critic "
            "model: trainer.critic.model.path) weighs equally over one critic mini-batch, "
            "as a term of its own ('vf'): token_mean (every active token, the default), "
            "seq_mean (every active response: SkyRL's own weighting where every response "
            "has an active token and every micro-batch is of one size), prompt_mean or "
            "constant (sum over tokens / (divisor x active responses))."
        ),
    )
    critic_group: str = group_field(
        "critic",
        "Reduction group of the critic's rounds within the job ('<critic_group>.sp<index>' "
        "with Ulysses sequence parallelism).",
    )

    @property
    def kl_reduction(self) -> PolicyGradientReduction:
        """The KL term's reduction."""
        return self._term(self.kl_mode)

    @property
    def entropy_reduction(self) -> PolicyGradientReduction:
        """The entropy term's reduction."""
        return self._term(self.entropy_mode)

    @property
    def critic_reduction(self) -> PolicyGradientReduction:
        """The critic's value loss's reduction."""
        return self._term(self.critic_mode)

    def _term(self, mode: PolicyGradientMode) -> PolicyGradientReduction:
        divisor = self.divisor if mode is PolicyGradientMode.CONSTANT else None
        return PolicyGradientReduction(mode, divisor)

    @model_validator(mode="after")
    def _divisor_where_constant(self) -> SkyRLReductionSettings:
        # The base class judges mode and divisor alone; the KL, entropy and value terms
        # may be the ones in 'constant'.
        constant = [
            name
            for name, mode in (
                ("mode", self.mode),
                ("kl_mode", self.kl_mode),
                ("entropy_mode", self.entropy_mode),
                ("critic_mode", self.critic_mode),
            )
            if mode is PolicyGradientMode.CONSTANT
        ]
        if constant and self.divisor is None:
            raise ValueError(
                f"{', '.join(constant)}='constant' needs divisor=C (the length budget)"
            )
        if self.divisor is not None and not constant:
            raise ValueError(
                f"divisor={self.divisor!r} is only valid when mode, kl_mode, entropy_mode or "
                "critic_mode is 'constant'"
            )
        if self.critic_group == self.group:
            raise ValueError(
                f"critic_group={self.critic_group!r} equals group: the policy's and the "
                "critic's rounds need groups of their own"
            )
        _ = self.kl_reduction, self.entropy_reduction, self.critic_reduction
        return self

    @property
    def reduction(self) -> PolicyGradientReduction:
        """The policy loss's reduction (``divisor`` only in ``constant``)."""
        return self._term(self.mode)
