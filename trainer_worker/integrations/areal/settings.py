"""How the AReaL actors normalize their PPO loss: one pydantic settings model.

Fields read ``LOSSREDUCE_*`` environment variables (``LOSSREDUCE_MODE``,
``LOSSREDUCE_NORMALIZER``, ``LOSSREDUCE_COORDINATOR``, ...) unless given
explicitly, so every SPMD rank and every RPC worker that AReaL starts reads
the same settings from the environment its launcher passes on. This module
does not import AReaL.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.normalizers import OnEmptyStep
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["ArealNormalizerBackend", "ArealReductionSettings"]

ArealNormalizerBackend = Literal["torch", "coordinator"]


class ArealReductionSettings(BaseSettings):
    """The reduction an AReaL PPO actor uses instead of its float32 token mean."""

    model_config = SettingsConfigDict(env_prefix="LOSSREDUCE_", frozen=True, extra="forbid")

    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            "What the policy-gradient term weighs equally over one optimizer step (one "
            "train_batch call): token_mean (every token, AReaL's own choice), seq_mean (every "
            "response), prompt_mean (every prompt group, i.e. every rollout episode) or "
            "constant (token sum / (divisor x responses)); see docs/reduction-semantics.md."
        ),
    )
    divisor: float | None = Field(
        default=None,
        description="The length budget C of mode 'constant' (e.g. gconfig.max_new_tokens); "
        "only valid with that mode.",
    )
    normalizer: ArealNormalizerBackend = Field(
        default="torch",
        description=(
            "Who sums the per-rank partial normalizers: 'torch' (torch.distributed over the "
            "engine's data-parallel group; the rank alone when that group has one rank) or "
            "'coordinator' (the lossreduce coordinator at `coordinator`, over gRPC)."
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
            "When an optimizer step has no active unit on any rank (every response masked): "
            "'raise' stops training with EmptyNormalizerError on every rank; 'skip' runs no "
            "forward, backward or optimizer step for it on any rank, so weights and optimizer "
            "state stay bit-identical, and reports update_successful=0."
        ),
    )
    job: str = Field(
        default="areal-ppo",
        min_length=1,
        description="Job name the rounds and errors carry (one per training run).",
    )
    group: str = Field(
        default="actor",
        min_length=1,
        description=(
            "Reduction group within the job. With tensor or sequence parallelism each "
            "model-parallel rank index reduces in its own group '<group>.mp<index>' of "
            "data-parallel size."
        ),
    )

    @property
    def reduction(self) -> PolicyGradientReduction:
        """The policy-gradient reduction these settings describe."""
        return PolicyGradientReduction(self.mode, self.divisor)

    @model_validator(mode="after")
    def _consistent(self) -> ArealReductionSettings:
        # PolicyGradientReduction owns the mode/divisor rules; let it judge them.
        _ = self.reduction
        if self.normalizer == "coordinator" and not self.coordinator:
            raise ValueError(
                "normalizer='coordinator' needs coordinator=HOST:PORT (or LOSSREDUCE_COORDINATOR)"
            )
        return self
