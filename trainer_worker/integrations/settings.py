"""How an integration normalizes its loss: one pydantic settings model per framework,
all built on :class:`ReductionSettings`, every field described.

Fields read ``LOSSREDUCE_*`` environment variables (``LOSSREDUCE_MODE``,
``LOSSREDUCE_NORMALIZER``, ``LOSSREDUCE_COORDINATOR``, ...) unless given
explicitly, so every rank a framework starts reads the same settings from the
environment its launcher passes on. This module imports no framework.

- :class:`GRPOReductionSettings`: TRL's ``LossReduceGRPOTrainer``;
- ``VerlReductionSettings`` (:mod:`lossreduce.trainer_worker.integrations.verl.settings`);
- ``ArealReductionSettings`` (:mod:`lossreduce.trainer_worker.integrations.areal.settings`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.integrations.run_identity import RUN_PATTERN, run_job
from lossreduce.trainer_worker.normalizers import OnEmptyStep
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = [
    "GRPOReductionSettings",
    "NormalizerBackend",
    "ReductionSettings",
    "group_field",
    "job_field",
    "ray_coordinator_field",
]

NormalizerBackend = Literal["torch", "coordinator"]


def job_field(default: str) -> Any:
    """The ``job`` field, with a framework's own default job name."""
    return Field(
        default=default,
        min_length=1,
        description=(
            f"Job name the rounds, errors and metrics carry. Unset: '{default}-<run>', new "
            "for every run; set (stable names on dashboards): taken as given, and the "
            "coordinator refuses a second run claiming it while the first is active."
        ),
    )


def ray_coordinator_field(who: str) -> Any:
    """The ``coordinator`` field of settings whose ranks join the job's coordinator actor
    on their Ray cluster when no address is given; ``who`` says which ranks, and how."""
    return Field(
        default=None,
        description="HOST:PORT of a lossreduce coordinator (`lossreduce serve`). None with "
        f"normalizer 'coordinator': {who} start or join the job's coordinator actor on "
        "their Ray cluster, with a fresh token, over TLS when the cluster has several nodes.",
    )


def group_field(
    default: str,
    description: str = "Reduction group within the job (one per set of ranks reducing together).",
) -> Any:
    """The ``group`` field, with a framework's own default group name."""
    return Field(default=default, min_length=1, description=description)


class ReductionSettings(BaseSettings):
    """What every integration's settings share: the policy-gradient mode, the normalizer
    backend, the coordinator and its client, empty steps, and the rounds' names.

    An *optimizer step* is what one global normalizer covers: TRL's optimizer step,
    one verl PPO mini-batch, one AReaL ``train_batch`` call.
    """

    model_config = SettingsConfigDict(env_prefix="LOSSREDUCE_", frozen=True, extra="forbid")

    joins_ray_coordinator: ClassVar[bool] = False
    """Whether ``normalizer='coordinator'`` without an address starts or joins the job's
    coordinator actor on the Ray cluster (else the address is required)."""

    mode: PolicyGradientMode = Field(
        default=PolicyGradientMode.TOKEN_MEAN,
        description=(
            "What the policy-gradient term weighs equally over one optimizer step: token_mean "
            "(every token), seq_mean (every response), prompt_mean (every prompt group) or "
            "constant (sum over tokens / (divisor x responses)); see "
            "docs/reduction-semantics.md. Fully masked responses and empty groups are never "
            "counted."
        ),
    )
    divisor: float | None = Field(
        default=None,
        description="The length budget C of mode 'constant' (e.g. the maximum response "
        "length); only valid with that mode.",
    )
    normalizer: NormalizerBackend = Field(
        default="torch",
        description=(
            "Who sums the ranks' partial normalizers: 'torch' (torch.distributed over the "
            "framework's data-parallel group; the rank alone when that group has one rank) or "
            "'coordinator' (a lossreduce coordinator over gRPC, at `coordinator`)."
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
            "backward or optimizer update for it on any rank, so weights, optimizer state and "
            "its step counter stay untouched."
        ),
    )
    job: str = job_field("lossreduce")
    group: str = group_field("policy")
    run: str | None = Field(
        default=None,
        pattern=RUN_PATTERN,
        description=(
            "This run's identity, the same on every rank (LOSSREDUCE_RUN). Unset: torchrun's "
            "TORCHELASTIC_RUN_ID, else a short random id rank 0 draws and shares over the "
            "framework's process group at the first step; a new run (and a resumed one) "
            "gets a new id."
        ),
    )

    @property
    def reduction(self) -> PolicyGradientReduction:
        """The policy-gradient reduction these settings describe."""
        return PolicyGradientReduction(self.mode, self.divisor)

    def job_of(self, run: str) -> str:
        """The job the rounds of ``run`` carry: ``job`` if it was given (argument or
        ``LOSSREDUCE_JOB``), else the framework's default with the run appended."""
        return run_job(self.job, run, explicit_job="job" in self.model_fields_set)

    @model_validator(mode="after")
    def _consistent(self) -> ReductionSettings:
        # PolicyGradientReduction owns the mode/divisor rules; let it judge them.
        _ = self.reduction
        needs_address = not (self.coordinator or self.joins_ray_coordinator)
        if self.normalizer == "coordinator" and needs_address:
            raise ValueError(
                "normalizer='coordinator' needs coordinator=HOST:PORT (or LOSSREDUCE_COORDINATOR)"
            )
        return self


class GRPOReductionSettings(ReductionSettings):
    """The reduction a TRL GRPO run uses instead of its ``loss_type`` normalization
    (the torch backend sums over accelerate's process group; the coordinator backend
    dials ``coordinator`` or, without one, the job's coordinator actor on the Ray
    cluster every process is connected to)."""

    joins_ray_coordinator: ClassVar[bool] = True

    coordinator: str | None = ray_coordinator_field(
        "the processes (each connected with ray.init before the trainer is built, which "
        "refuses to start otherwise)"
    )
    overlap: bool = Field(
        default=True,
        description=(
            "Run an optimizer step's first forward while its normalizer round is in flight "
            "and wait before the backward, where that is exact (the policy-gradient term "
            "alone: beta=0, no entropy bonus, no router aux loss; a first micro-step "
            "that leaves no DDP synchronization pending; a round not answered at its start). "
            "False: wait before the forward; with 'skip', a forward already run while the "
            "round was in flight is discarded."
        ),
    )
    job: str = job_field("trl-grpo")
