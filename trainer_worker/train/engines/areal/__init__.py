"""``--engine areal``: AReaL's FSDP PPO actor with lossreduce's reduction on every worker.

Each worker (:mod:`.worker`) runs
:class:`~lossreduce.trainer_worker.integrations.areal.LossReduceFSDPPPOActor`
on the built-in tiny Qwen2 over the task's ids (:mod:`.model`), samples its
slice of the step's prompts from it with the job's own sampler (AReaL's
inference servers, SGLang and vLLM, need a GPU stack) and runs AReaL's PPO
update on its shard of whole prompt groups (:mod:`.task`: the rollouts as
AReaL's trajectory dicts); the driver's side is :mod:`.engine`. Needs AReaL
1.0.4 installed as docs/frameworks/areal.md says: only :meth:`EngineSpec.load`
imports it.
"""

from __future__ import annotations

import importlib

from lossreduce.trainer_worker.train.engines.areal.flags import check_flags
from lossreduce.trainer_worker.train.engines.base import EngineFactory, EngineSpec

__all__ = ["ENGINE"]


def _load() -> EngineFactory:
    # In this order: AReaL silenced before it is imported (quiet does so on import), then
    # the integration, which says in one line that AReaL is missing (and how to install
    # it) or is a version it was not tested with.
    for module in (f"{__name__}.quiet", "lossreduce.trainer_worker.integrations.areal"):
        importlib.import_module(module)
    from lossreduce.trainer_worker.train.engines.areal.engine import ArealEngine

    return ArealEngine


ENGINE = EngineSpec(
    name="areal",
    summary="AReaL's FSDP PPO actor per worker, LossReduceFSDPPPOActor; needs AReaL 1.0.4 "
    "(docs/frameworks/areal.md)",
    check_flags=check_flags,
    load=_load,
)
