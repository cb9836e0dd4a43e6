"""How the AReaL actors normalize their PPO loss: :class:`ArealReductionSettings`.

Fields read ``LOSSREDUCE_*`` environment variables unless given explicitly, so
every SPMD rank and every RPC worker that AReaL starts reads the same settings
from the environment its launcher passes on. This module does not import AReaL.
"""

from __future__ import annotations

from lossreduce.trainer_worker.integrations.settings import (
    ReductionSettings,
    group_field,
    job_field,
)

__all__ = ["ArealReductionSettings"]


class ArealReductionSettings(ReductionSettings):
    """The reduction an AReaL PPO actor uses instead of its float32 token mean.

    One optimizer step is one ``train_batch`` call; ``prompt_mean`` weighs every
    rollout episode (prompt group) equally; ``constant``'s divisor is typically
    ``gconfig.max_new_tokens``. A skipped empty step reports ``update_successful=0``.
    """

    job: str = job_field("areal-ppo")
    group: str = group_field(
        "actor",
        "Reduction group within the job. With tensor or sequence parallelism each "
        "model-parallel rank index reduces in its own group '<group>.mp<index>' of "
        "data-parallel size.",
    )
