"""The LossReduce versions of AReaL's actor classes.

Module-level classes, so that AReaL's single-controller mode, which names an
engine class by its import path to the RPC workers it starts, can build them
there too (the workers read the ``LOSSREDUCE_*`` settings from their
environment).
"""

from __future__ import annotations

import functools
from typing import Any

from areal.engine.fsdp_engine import FSDPPPOActor
from areal.experimental.engine.archon_engine import ArchonPPOActor

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.areal.actor import LossReduceActorMixin
from lossreduce.trainer_worker.integrations.areal.settings import ArealReductionSettings

__all__ = [
    "LossReduceArchonPPOActor",
    "LossReduceFSDPPPOActor",
    "areal_actor_class",
    "lossreduce_actor",
]


class LossReduceFSDPPPOActor(LossReduceActorMixin, FSDPPPOActor):  # type: ignore[misc]
    """AReaL's ``FSDPPPOActor`` with lossreduce's reduction (tested against AReaL 1.0.4)."""

    def __init__(self, config: Any, *, reduction: ArealReductionSettings | None = None) -> None:
        super().__init__(config, reduction=reduction)


class LossReduceArchonPPOActor(LossReduceActorMixin, ArchonPPOActor):  # type: ignore[misc]
    """AReaL's ``ArchonPPOActor`` with lossreduce's reduction (tested against AReaL 1.0.4
    on CPU, with the CPU settings of
    :mod:`lossreduce.trainer_worker.cpu_standins.areal.archon`)."""

    def __init__(self, config: Any, *, reduction: ArealReductionSettings | None = None) -> None:
        super().__init__(config, reduction=reduction)


_TESTED: dict[type[Any], type[Any]] = {
    FSDPPPOActor: LossReduceFSDPPPOActor,
    ArchonPPOActor: LossReduceArchonPPOActor,
}


@functools.cache
def lossreduce_actor(actor_cls: type[Any]) -> type[Any]:
    """``actor_cls`` (an AReaL PPO actor class) with :class:`LossReduceActorMixin` before it.

    ``lossreduce_actor(FSDPPPOActor)`` is :class:`LossReduceFSDPPPOActor` and
    ``lossreduce_actor(ArchonPPOActor)`` :class:`LossReduceArchonPPOActor`;
    ``MegatronPPOActor`` gets the same mixin (see docs/frameworks/areal.md for what
    runs of it). One class per ``actor_cls``, made on the first call.
    """
    if actor_cls in _TESTED:
        return _TESTED[actor_cls]
    name = f"LossReduce{actor_cls.__name__}"
    return type(name, (LossReduceActorMixin, actor_cls), {"__module__": __name__})


def areal_actor_class(backend: str) -> type[Any]:
    """AReaL's own PPO actor class for the engine part of ``actor.backend`` (``fsdp``,
    ``megatron`` or ``archon``); Megatron's is imported only when asked for, since it
    needs AReaL's ``[megatron]`` packages.

    Raises ReductionConfigError naming ``backend`` for any other engine.
    """
    actor_cls: type[Any]
    if backend == "fsdp":
        actor_cls = FSDPPPOActor
    elif backend == "archon":
        actor_cls = ArchonPPOActor
    elif backend == "megatron":
        from areal.engine.megatron_engine import MegatronPPOActor

        actor_cls = MegatronPPOActor
    else:
        raise ReductionConfigError(
            f"AReaL actor.backend {backend!r} is not one of fsdp, megatron, archon"
        )
    return actor_cls
