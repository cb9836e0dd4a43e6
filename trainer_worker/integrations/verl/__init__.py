"""lossreduce inside verl's engine workers (``pip install 'lossreduce[verl]'``).

- :class:`LossReduceTrainingWorker`: verl's ``TrainingWorker`` whose every PPO
  mini-batch is normalized by lossreduce's validated global normalizers;
- :class:`LossReduceActorRolloutRefWorker`: verl's ``ActorRolloutRefWorker``
  building its actor from it;
- :class:`LossReduceCriticWorker`: verl's critic ``TrainingWorker`` (PPO with
  ``algorithm.adv_estimator=gae``) whose value loss has a normalizer of its own;
- :class:`VerlReductionSettings`: how (``LOSSREDUCE_*`` or the config's
  ``lossreduce`` key).

A verl launch selects it with ``trainer.v1.trainer_mode=lossreduce`` (the
trainer mode :mod:`.plugin` registers; verl loads that module in every process
through the ``verl.plugins`` entry point). The worker classes import verl when
first used; the settings, the plan and the option rules do not import verl, so
verl may load an external platform module (``VERL_USE_EXTERNAL_MODULES``, e.g. the
tests' CPU platform) while it is itself being imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings

if TYPE_CHECKING:
    from lossreduce.trainer_worker.integrations.verl.critic import LossReduceCriticWorker
    from lossreduce.trainer_worker.integrations.verl.worker import (
        LossReduceActorRolloutRefWorker,
        LossReduceTrainingWorker,
    )

__all__ = [
    "LossReduceActorRolloutRefWorker",
    "LossReduceCriticWorker",
    "LossReduceTrainingWorker",
    "VerlReductionSettings",
]

_WORKERS = ("LossReduceActorRolloutRefWorker", "LossReduceTrainingWorker")


def __getattr__(name: str) -> object:
    # The workers subclass verl's: import verl only when they are asked for.
    if name in _WORKERS:
        from lossreduce.trainer_worker.integrations.verl import worker

        return getattr(worker, name)
    if name == "LossReduceCriticWorker":
        from lossreduce.trainer_worker.integrations.verl import critic

        return critic.LossReduceCriticWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
