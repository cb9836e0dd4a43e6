"""How :class:`~lossreduce.trainer_worker.integrations.verl.LossReduceTrainingWorker`
normalizes verl's actor loss: one pydantic settings model, every field described.

Fields read ``LOSSREDUCE_*`` environment variables (``LOSSREDUCE_MODE``,
``LOSSREDUCE_NORMALIZER``, ``LOSSREDUCE_COORDINATOR``, ...) unless given
explicitly; verl starts its workers as Ray actors, which inherit the driver's
environment through Ray's runtime env. This module does not import verl.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.normalizers import OnEmptyStep
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["VerlNormalizerBackend", "VerlReductionSettings"]

VerlNormalizerBackend = Literal["torch", "coordinator"]


class VerlReductionSettings(BaseSettings):
    """The reduction a verl actor uses instead of its ``loss_agg_mode`` normalization."""

    model_config = SettingsConfigDict(env_prefix="LOSSREDUCE_", frozen=True, extra="forbid")

    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            "What the policy-gradient term weighs equally over one PPO mini-batch (one "
            "optimizer step): token_mean (every token), seq_mean (every response), "
            "prompt_mean (every prompt group, by verl's `uid`) or constant (sum over tokens / "
            "(divisor x responses)); see docs/reduction-semantics.md. Fully masked responses "
            "and groups are never counted."
        ),
    )
    divisor: float | None = Field(
        default=None,
        description="The length budget C of mode 'constant' (e.g. the maximum response "
        "length); only valid with that mode.",
    )
    normalizer: VerlNormalizerBackend = Field(
        default="torch",
        description=(
            "Who sums the ranks' partial normalizers: 'torch' (torch.distributed over the "
            "engine's data-parallel group) or 'coordinator' (a lossreduce coordinator at "
            "`coordinator`, over gRPC)."
        ),
    )
    coordinator: str | None = Field(
        default=None,
        description="HOST:PORT of the lossreduce coordinator (`lossreduce serve`); required "
        "when normalizer is 'coordinator'.",
    )
    client: ClientSettings = Field(
        default_factory=ClientSettings,
        description="Deadlines, retries and credentials of the coordinator client "
        "(the token defaults to LOSSREDUCE_TOKEN).",
    )
    on_empty_step: OnEmptyStep = Field(
        default="raise",
        description=(
            "When a mini-batch has no active unit on any rank (every response masked): "
            "'raise' stops training with EmptyNormalizerError on every rank; 'skip' runs no "
            "forward, backward or optimizer step for it on any rank, so weights, optimizer "
            "state and its step counter stay untouched (verl's own run would decay every "
            "weight and count a step)."
        ),
    )
    job: str = Field(
        default="verl-ppo",
        min_length=1,
        description="Job name the rounds and errors carry (one per training run).",
    )
    group: str = Field(
        default="actor",
        min_length=1,
        description="Reduction group within the job (one per set of ranks reducing together).",
    )

    @property
    def reduction(self) -> PolicyGradientReduction:
        """The policy-gradient reduction these settings describe."""
        return PolicyGradientReduction(self.mode, self.divisor)

    @model_validator(mode="after")
    def _consistent(self) -> VerlReductionSettings:
        # PolicyGradientReduction owns the mode/divisor rules; let it judge them.
        _ = self.reduction
        if self.normalizer == "coordinator" and not self.coordinator:
            raise ValueError(
                "normalizer='coordinator' needs coordinator=HOST:PORT (or LOSSREDUCE_COORDINATOR)"
            )
        return self
