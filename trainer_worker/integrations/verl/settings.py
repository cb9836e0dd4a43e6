"""How :class:`~lossreduce.trainer_worker.integrations.verl.LossReduceTrainingWorker`
normalizes verl's actor loss: :class:`VerlReductionSettings`, every field described.

Fields read ``LOSSREDUCE_*`` environment variables unless given explicitly;
verl starts its workers as Ray actors, which inherit the driver's environment
through Ray's runtime env. This module does not import verl.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from lossreduce.trainer_worker.integrations.settings import (
    ReductionSettings,
    group_field,
    job_field,
)

__all__ = ["VerlReductionSettings"]


class VerlReductionSettings(ReductionSettings):
    """The reduction a verl actor uses instead of its ``loss_agg_mode`` normalization.

    One optimizer step is one PPO mini-batch; ``prompt_mean`` groups responses by
    verl's prompt ``uid``. With ``on_empty_step='skip'`` an empty mini-batch runs no
    forward either (verl's own run would decay every weight and count a step).
    """

    joins_ray_coordinator: ClassVar[bool] = True

    coordinator: str | None = Field(
        default=None,
        description="HOST:PORT of a lossreduce coordinator (`lossreduce serve`). None with "
        "normalizer 'coordinator': the ranks start or join the job's coordinator actor on "
        "their Ray cluster, with a fresh token, over TLS when the cluster has several nodes.",
    )
    job: str = job_field("verl-ppo")
    group: str = group_field("actor")
