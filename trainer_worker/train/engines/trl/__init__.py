"""``--engine trl``: one Hugging Face TRL GRPO process per worker.

Each worker (:mod:`.worker`) runs :class:`~lossreduce.trainer_worker.integrations.trl.LossReduceGRPOTrainer`
on a policy checkpoint (:mod:`.model`: ``--model`` or a tiny Qwen2 built from its
config) over the digit task rendered as text (:mod:`.task`), with the reduction
settings of :mod:`.reduction`; the driver's side is :mod:`.engine`. Needs ``pip install 'lossreduce[trl]'``: only :meth:`EngineSpec.load`
imports TRL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossreduce.trainer_worker.train.engines.base import EngineFactory, EngineSpec
from lossreduce.trainer_worker.train.engines.trl.flags import check_flags

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["ENGINE"]


def _check_environment(settings: TrainSettings) -> None:
    # Imported here: listing the engines and printing --help build no settings.
    from lossreduce.trainer_worker.train.engines.trl.reduction import check_environment

    check_environment(settings)


def _load() -> EngineFactory:
    from lossreduce.trainer_worker.train.engines.trl.engine import TRLEngine

    return TRLEngine


ENGINE = EngineSpec(
    name="trl",
    summary="one Hugging Face TRL GRPO process per worker, LossReduceGRPOTrainer; needs "
    "pip install 'lossreduce[trl]'",
    check_flags=check_flags,
    load=_load,
    check_environment=_check_environment,
)
