"""verl's Megatron engine on CPU: mbridge's fix, then the one CPU platform for Megatron.

Importing this module (``VERL_USE_EXTERNAL_MODULES`` names it after verl's CPU platform:
:data:`.env.MEGATRON_CPU_ENV`) makes the process run verl 0.9.1's ``MegatronEngine`` on
the CPU, changing no installed file:

1. :func:`lossreduce.trainer_worker.integrations.mbridge_compat.install`: mbridge 0.15.1
   against Megatron-Core 0.19 (verl's ``vanilla_mbridge=True`` builds the model through
   mbridge; its default, Megatron-Bridge, imports Transformer Engine, a CUDA build);
2. :func:`lossreduce.trainer_worker.cpu_standins.megatron.platform.install`: the local
   layer spec, packed attention, CPU RNG tracker and streams;
3. every method of verl's Megatron engine classes runs inside the platform's
   ``CudaToCpu`` mode, and so do the generators they return (the weight export): verl's
   engine runs on the CPU device of verl's CPU platform, while mbridge and Megatron-Core
   still name CUDA devices (``model.cuda(...)``, ``torch.cuda.*Tensor`` parameter types).
   Per call rather than per thread: a torch function mode is thread-local, and verl's Ray
   workers run their methods on a pool of threads.

The engine is then configured as on a GPU but for ``vanilla_mbridge=True``. Megatron's
context parallelism needs Transformer Engine's attention and does not run here (see the
platform). For CPU runs and tests only.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

from verl.workers.engine.megatron import transformer_impl

from lossreduce.trainer_worker.cpu_standins.megatron import platform
from lossreduce.trainer_worker.integrations import mbridge_compat

__all__ = ["ENGINE_CLASSES", "install"]

ENGINE_CLASSES = (
    transformer_impl.MegatronEngine,
    transformer_impl.MegatronEngineWithLMHead,
    transformer_impl.MegatronEngineWithValueHead,
)
"""verl's Megatron engines whose methods :func:`install` runs on the CPU."""


def _on_cpu(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with platform.CudaToCpu():
            out = method(*args, **kwargs)
        return _lazy_on_cpu(out)

    call.lossreduce_on_cpu = True  # type: ignore[attr-defined]
    return call


def _lazy_on_cpu(value: Any) -> Any:
    """A generator (alone or in a plain tuple) whose every step runs in the mode."""
    if isinstance(value, types.GeneratorType):
        return _steps_on_cpu(value)
    if type(value) is tuple:
        return tuple(_lazy_on_cpu(v) for v in value)
    return value


def _steps_on_cpu(generator: Iterator[Any]) -> Iterator[Any]:
    while True:
        with platform.CudaToCpu():
            try:
                item = next(generator)
            except StopIteration:
                return
        yield item


def install() -> None:
    """mbridge's fix, the Megatron CPU platform and verl's engine methods on the CPU,
    in this process (idempotent)."""
    mbridge_compat.install()
    platform.install()
    for cls in ENGINE_CLASSES:
        for name, attr in list(vars(cls).items()):
            wanted = name == "__init__" or not name.startswith("__")
            if wanted and inspect.isfunction(attr) and not hasattr(attr, "lossreduce_on_cpu"):
                setattr(cls, name, _on_cpu(attr))


install()
