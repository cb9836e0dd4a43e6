"""``--engine torch``: lossreduce's own engine and policy.

Each worker (:mod:`.worker`) holds a small causal transformer (:mod:`.model`),
samples the digit task's rollouts from it (:mod:`.task`), and trains on its
shard of whole prompt groups with the GRPO loss (:mod:`.grpo`) through
:class:`~lossreduce.trainer_worker.engine.TorchTrainEngine`; the driver's side
is :mod:`.engine`, ``--verify``'s one-process replay :mod:`.replay`.
"""

from __future__ import annotations

from lossreduce.trainer_worker.train.engines.base import EngineFactory, EngineSpec
from lossreduce.trainer_worker.train.engines.torch.flags import check_flags

__all__ = ["ENGINE"]


def _load() -> EngineFactory:
    from lossreduce.trainer_worker.train.engines.torch.engine import TorchEngine

    return TorchEngine


ENGINE = EngineSpec(
    name="torch",
    summary="lossreduce's own engine and policy (TorchTrainEngine)",
    check_flags=check_flags,
    load=_load,
)
