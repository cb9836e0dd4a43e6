"""The ``lossreduce`` trainer mode of verl, loaded as a verl plugin.

verl imports every ``verl.plugins`` entry point in every process when ``verl``
is imported (``VERL_USE_EXTERNAL_PLUGINS``, default ``auto``); lossreduce's
entry point names this module, which registers the trainer mode
``lossreduce``: verl's synchronous PPO trainer (``sync``) whose actor workers
are :class:`~lossreduce.trainer_worker.integrations.verl.LossReduceActorRolloutRefWorker`.
A launch selects it with ``trainer.v1.trainer_mode=lossreduce``; without the
entry point (e.g. lossreduce not installed as a package)
``VERL_USE_EXTERNAL_MODULES=lossreduce.trainer_worker.integrations.verl.plugin``
loads it the same way.
"""

from __future__ import annotations

import ray
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.engine_workers import ActorRolloutRefWorker

from lossreduce.trainer_worker.integrations.verl.worker import LossReduceActorRolloutRefWorker

__all__ = ["TRAINER_MODE", "LossReducePPOTrainer", "actor_worker_mapping"]

TRAINER_MODE = "lossreduce"
"""The ``trainer.v1.trainer_mode`` that selects lossreduce's actor."""


def actor_worker_mapping(mapping: dict[object, object]) -> dict[object, object]:
    """``mapping`` (role -> Ray actor class) with every ``ActorRolloutRefWorker`` role
    that trains the actor built from lossreduce's worker instead."""
    ours = ray.remote(LossReduceActorRolloutRefWorker)
    swapped = dict(mapping)
    for role, remote in mapping.items():
        name = str(role)
        if (
            name.startswith("actor")
            and getattr(remote, "__ray_actor_class__", None) is ActorRolloutRefWorker
        ):
            swapped[role] = ours
    return swapped


@register_trainer(TRAINER_MODE)
class LossReducePPOTrainer(PPOTrainerSync):  # type: ignore[misc]
    """verl's synchronous PPO trainer with lossreduce's actor workers."""

    role_worker_mapping: dict[object, object]

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        self.role_worker_mapping = actor_worker_mapping(self.role_worker_mapping)
