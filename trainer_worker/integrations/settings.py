"""How an integration (e.g. :class:`~lossreduce.trainer_worker.integrations.trl.LossReduceGRPOTrainer`)
normalizes its loss: one pydantic settings model, every field described.

Fields read ``LOSSREDUCE_*`` environment variables (``LOSSREDUCE_MODE``,
``LOSSREDUCE_COORDINATOR``, ...) unless given explicitly. This module imports
no framework.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.normalizers import OnEmptyStep
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["GRPOReductionSettings", "NormalizerBackend"]

NormalizerBackend = Literal["torch", "coordinator"]


class GRPOReductionSettings(BaseSettings):
    """The reduction a TRL GRPO run uses instead of its ``loss_type`` normalization."""

    model_config = SettingsConfigDict(env_prefix="LOSSREDUCE_", frozen=True, extra="forbid")

    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            "What the policy-gradient term weighs equally over one optimizer step: token_mean "
            "(every token), seq_mean (every completion), prompt_mean (every prompt group) or "
            "constant (sum over tokens / (divisor x completions)); see docs/reduction-semantics.md."
        ),
    )
    divisor: float | None = Field(
        default=None,
        description="The length budget C of mode 'constant' (e.g. max_completion_length); "
        "only valid with that mode.",
    )
    normalizer: NormalizerBackend = Field(
        default="torch",
        description=(
            "Who sums the per-process partial normalizers: 'torch' (torch.distributed over "
            "accelerate's process group; the local process alone when there is one) or "
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
            "When an optimizer step has no active unit on any process (e.g. every completion "
            "masked as truncated): 'raise' stops training with EmptyNormalizerError on every "
            "process; 'skip' runs no backward or optimizer update for that step on any "
            "process and leaves weights and optimizer state untouched (a forward already run "
            "while the round was in flight is discarded)."
        ),
    )
    overlap: bool = Field(
        default=True,
        description=(
            "Run an optimizer step's first forward while its normalizer round is in flight "
            "and wait before the backward, where that is exact (the policy-gradient term "
            "alone: beta=0, no entropy bonus, no router aux loss; a first micro-step "
            "that leaves no DDP synchronization pending; a round not answered at its start). "
            "False: wait before the forward."
        ),
    )
    job: str = Field(
        default="trl-grpo",
        min_length=1,
        description="Job name the rounds and errors carry (one per training run).",
    )
    group: str = Field(
        default="policy",
        min_length=1,
        description="Reduction group within the job (one per set of processes reducing together).",
    )

    @property
    def reduction(self) -> PolicyGradientReduction:
        """The policy-gradient reduction these settings describe."""
        return PolicyGradientReduction(self.mode, self.divisor)

    @model_validator(mode="after")
    def _consistent(self) -> GRPOReductionSettings:
        # PolicyGradientReduction owns the mode/divisor rules; let it judge them.
        _ = self.reduction
        if self.normalizer == "coordinator" and not self.coordinator:
            raise ValueError(
                "normalizer='coordinator' needs coordinator=HOST:PORT (or LOSSREDUCE_COORDINATOR)"
            )
        return self
