"""lossreduce inside SkyRL 0.4's training loop (``pip install 'lossreduce[skyrl]'``).

- :class:`LossReducePolicyWorker`: SkyRL's FSDP policy worker whose every policy
  mini-batch is normalized by lossreduce's validated global normalizers, the policy
  loss in lossreduce's mode and SkyRL's KL and entropy losses as terms of their own;
- :class:`LossReduceCriticWorker`: SkyRL's FSDP critic worker, its value loss the term
  ``vf`` in ``critic_mode``, with the same validation;
- :class:`LossReduceRayPPOTrainer`: SkyRL's ``RayPPOTrainer`` building those workers and
  leaving the division of the advantages to them, its z-score over active tokens; :class:`LossReducePPOExp` returns it
  from ``get_trainer``;
- :class:`SkyRLReductionSettings`: how (the launch's ``trainer.lossreduce`` block
  over ``LOSSREDUCE_*``).

A SkyRL launch selects it with
``trainer.override_entrypoint=lossreduce.trainer_worker.integrations.skyrl.entrypoint``
(SkyRL's ``main_base`` dispatches to :mod:`.entrypoint`). The worker, trainer and
entrypoint import SkyRL when first used, and check its version then; the settings,
the plan and the option rules do not import SkyRL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossreduce.trainer_worker.integrations.skyrl.settings import SkyRLReductionSettings
from lossreduce.trainer_worker.integrations.skyrl.version import SKYRL_TESTED, check_skyrl_version

if TYPE_CHECKING:
    from lossreduce.trainer_worker.integrations.skyrl.critic import LossReduceCriticWorker
    from lossreduce.trainer_worker.integrations.skyrl.trainer import (
        LossReducePPOExp,
        LossReduceRayPPOTrainer,
    )
    from lossreduce.trainer_worker.integrations.skyrl.worker import LossReducePolicyWorker

__all__ = [
    "SKYRL_TESTED",
    "LossReduceCriticWorker",
    "LossReducePPOExp",
    "LossReducePolicyWorker",
    "LossReduceRayPPOTrainer",
    "SkyRLReductionSettings",
    "check_skyrl_version",
]

_LAZY = {
    "LossReduceCriticWorker": "critic",
    "LossReducePolicyWorker": "worker",
    "LossReduceRayPPOTrainer": "trainer",
    "LossReducePPOExp": "trainer",
}


def __getattr__(name: str) -> object:
    # The worker and trainer subclass SkyRL's: import SkyRL only when they are asked for.
    if name in _LAZY:
        from importlib import import_module

        from lossreduce.trainer_worker.integrations.skyrl.version import require_skyrl

        require_skyrl()

        module = import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
