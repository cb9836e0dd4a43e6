"""lossreduce inside verl's engine workers (``pip install 'lossreduce[verl]'``).

- :class:`LossReduceTrainingWorker`: verl's ``TrainingWorker`` whose every PPO
  mini-batch is normalized by lossreduce's validated global normalizers;
- :class:`LossReduceActorRolloutRefWorker`: verl's ``ActorRolloutRefWorker``
  building its actor from it;
- :class:`VerlReductionSettings`: how (``LOSSREDUCE_*`` or the config's
  ``lossreduce`` key).

A verl launch selects it with ``trainer.v1.trainer_mode=lossreduce`` (the
trainer mode :mod:`.plugin` registers; verl loads that module in every process
through the ``verl.plugins`` entry point). Importing this package imports verl;
importing :mod:`lossreduce.trainer_worker` never does.
"""

from lossreduce.trainer_worker.integrations.verl.settings import (
    VerlNormalizerBackend,
    VerlReductionSettings,
)
from lossreduce.trainer_worker.integrations.verl.worker import (
    LossReduceActorRolloutRefWorker,
    LossReduceTrainingWorker,
)

__all__ = [
    "LossReduceActorRolloutRefWorker",
    "LossReduceTrainingWorker",
    "VerlNormalizerBackend",
    "VerlReductionSettings",
]
