"""Every engine of ``lossreduce train``, by name: one line per engine.

An engine is a package under :mod:`lossreduce.trainer_worker.train.engines`
whose ``__init__`` defines ``ENGINE``, an
:class:`~lossreduce.trainer_worker.train.engines.base.EngineSpec`, and imports
nothing heavy: listing the engines, checking flags and printing ``--help``
import no framework. Adding an engine is adding its folder and its line in
:data:`ENGINE_PACKAGES`.
"""

from __future__ import annotations

import importlib
from functools import cache

from lossreduce.trainer_worker.train.engines.base import EngineSpec

__all__ = ["ENGINE_PACKAGES", "engine_names", "get_engine"]

ENGINE_PACKAGES = {
    "torch": "lossreduce.trainer_worker.train.engines.torch",
    "trl": "lossreduce.trainer_worker.train.engines.trl",
    "verl": "lossreduce.trainer_worker.train.engines.verl",
    "areal": "lossreduce.trainer_worker.train.engines.areal",
}
"""``--engine`` value -> the package that defines its ``ENGINE``."""


def engine_names() -> tuple[str, ...]:
    """The values ``--engine`` accepts, in registry order."""
    return tuple(ENGINE_PACKAGES)


@cache
def get_engine(name: str) -> EngineSpec:
    """The engine registered as ``name``; KeyError naming the choices otherwise."""
    try:
        package = ENGINE_PACKAGES[name]
    except KeyError:
        raise KeyError(
            f"no engine {name!r}; registered engines: {', '.join(ENGINE_PACKAGES)}"
        ) from None
    spec = importlib.import_module(package).ENGINE
    assert isinstance(spec, EngineSpec), f"{package}.ENGINE is not an EngineSpec"
    assert spec.name == name, f"{package}.ENGINE is named {spec.name!r}, not {name!r}"
    return spec
