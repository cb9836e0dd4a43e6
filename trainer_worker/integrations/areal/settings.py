"""How the AReaL actors normalize their PPO loss: :class:`ArealReductionSettings`.

Fields read ``LOSSREDUCE_*`` environment variables unless given explicitly, so
every SPMD rank and every RPC worker that AReaL starts reads the same settings
from the environment its launcher passes on. This module does not import AReaL.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from lossreduce.trainer_worker.integrations.settings import (
    ReductionSettings,
    group_field,
    job_field,
    ray_coordinator_field,
)

__all__ = ["ArealReductionSettings"]


class ArealReductionSettings(ReductionSettings):
    """The reduction an AReaL PPO actor uses instead of its float32 token mean.

    One optimizer step is one ``train_batch`` call; ``prompt_mean`` weighs every
    rollout episode (prompt group) equally; ``constant``'s divisor is typically
    ``gconfig.max_new_tokens``. A skipped empty step reports ``update_successful=0``.
    """

    joins_ray_coordinator: ClassVar[bool] = True

    coordinator: str | None = ray_coordinator_field(
        "the actor's ranks, run as Ray actors (AReaL's Ray scheduler, `lossreduce train --engine areal`) or connected with ray.init,"
    )
    job: str = job_field("areal-ppo")
    group: str = group_field(
        "actor",
        "Reduction group within the job. With tensor or sequence parallelism each "
        "model-parallel rank index reduces in its own group '<group>.mp<index>' of "
        "data-parallel size.",
    )
    m2po: Literal["global", "local"] = Field(
        default="global",
        description=(
            "How AReaL's M2PO mask (actor.m2_threshold) is decided. 'global': before the "
            "forward, over every active token of the optimizer step on every rank (one "
            "cut-off reduced by the normalizer backend), so the update does not depend on "
            "the micro-batch split; tokens it masks leave the numerator and the normalizers. "
            "Needs a prox_logp known before the forward (prox_logp_method recompute or "
            "metrics). 'local': AReaL's own mask, decided by its loss for each micro-batch "
            "alone; which tokens train then depends on how the step is split over ranks "
            "and micro-batches (docs/frameworks/areal.md)."
        ),
    )
