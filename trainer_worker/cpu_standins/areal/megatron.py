"""AReaL's Megatron engine on CPU: AReaL's version fixes, then the Megatron platform.

:func:`install` applies :func:`lossreduce.trainer_worker.integrations.areal.megatron_compat.install`
(what AReaL 1.0.4's ``[megatron]`` pins need on any device, a GPU too) and then the
framework-neutral CPU platform of
:mod:`lossreduce.trainer_worker.cpu_standins.megatron.platform`. Run the engine inside
that platform's ``CudaToCpu`` mode afterwards. Needs AReaL's Megatron packages
(megatron-core, mbridge).
"""

from __future__ import annotations

from lossreduce.trainer_worker.cpu_standins.megatron import platform
from lossreduce.trainer_worker.integrations.areal import megatron_compat

__all__ = ["install"]


def install() -> None:
    """Make this process run AReaL's ``MegatronEngine`` on CPU (idempotent)."""
    megatron_compat.install()
    platform.install()
