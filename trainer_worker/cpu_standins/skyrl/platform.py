"""A CPU platform for SkyRL 0.4's FSDP workers, so that its real policy and reference
workers train without a GPU (the tests, the bench, the CPU launch).

SkyRL's FSDP workers assume CUDA in a handful of places; each is redirected here,
in the process that runs the worker, without changing a file of SkyRL:

1. **flash-attn without its kernels.** ``workers/model_wrapper.py`` imports
   ``flash_attn.bert_padding`` at module load, and ``flash_attn/__init__.py`` imports
   its CUDA extension ``flash_attn_2_cuda``, which a build with
   ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE`` (the only build possible without CUDA)
   lacks. A stand-in module of that name is registered; calling any of its kernels
   raises :class:`FlashAttentionKernelMissingError`. ``bert_padding`` (pure torch) is
   flash-attn's own. Run with ``trainer.flash_attn=false`` and
   ``trainer.remove_microbatch_padding=false`` (SDPA attention, padded micro-batches).
2. **Collectives.** ``init_worker_process_group`` asks for
   ``backend="cpu:gloo,cuda:nccl"`` and builds its device mesh (and
   ``create_device_mesh`` the FSDP mesh) on ``"cuda"``: here the backend is gloo and
   every mesh is a CPU mesh.
3. **Devices.** ``torch.cuda.current_device()`` answers ``"cpu"`` (SkyRL moves
   micro-batches, gradient norms and metrics there); ``Tensor.cuda()`` leaves a CPU
   tensor where it is; ``set_device``, ``synchronize``, ``empty_cache`` and the memory
   statistics do nothing; the broadcast of non-persistent buffers from rank 0
   (``fsdp_utils._sync_non_persistent_buffers``, which allocates on ``"cuda"``) runs on
   CPU tensors.

:func:`install` applies all of it once per process; the SkyRL modules it changes are
changed when they are first imported (:func:`after_import`), so that a process that
never imports them (most of a Ray job's workers) pays nothing for them. The CPU
launch (:mod:`.launch`) runs it in every Ray worker process. Only CPU-only runs need
it; a GPU run never imports it. It imports no SkyRL itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FlashAttentionKernelMissingError",
    "after_import",
    "install",
    "installed",
]

FSDP_UTILS = "skyrl.backends.skyrl_train.distributed.fsdp_utils"

_STATE = {"installed": False}


class FlashAttentionKernelMissingError(RuntimeError):
    """A flash-attn CUDA kernel was called in a process where only the stand-in exists."""


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _STATE["installed"]


def install() -> None:
    """Redirect SkyRL's CUDA assumptions in this process to the CPU (idempotent)."""
    if _STATE["installed"]:
        return
    if torch.cuda.is_available():
        # A GPU process keeps SkyRL as it is: this platform would only slow it down.
        return
    _standin_flash_attention_kernels()
    _cpu_devices()
    _gloo_collectives()
    after_import(FSDP_UTILS, _cpu_fsdp_utils)
    _STATE["installed"] = True


def _cpu_fsdp_utils(fsdp_utils: types.ModuleType) -> None:
    fsdp_utils._sync_non_persistent_buffers = _broadcast_non_persistent_buffers  # type: ignore[attr-defined]
    fsdp_utils.init_device_mesh = _cpu_mesh(fsdp_utils.init_device_mesh)  # type: ignore[attr-defined]


def after_import(name: str, patch: Callable[[types.ModuleType], None]) -> None:
    """Call ``patch(module)`` once module ``name`` has been imported: now if it has,
    else right after its code runs (a ``sys.meta_path`` finder wraps its loader)."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    sys.meta_path.insert(0, _AfterImport(name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders for ``name`` and wraps the loader."""

    def __init__(self, name: str, patch: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: types.ModuleType) -> None:
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# -- 1. flash-attn --------------------------------------------------------------------


def _standin_flash_attention_kernels() -> None:
    if "flash_attn_2_cuda" in sys.modules:
        return
    module = types.ModuleType("flash_attn_2_cuda")
    module.__doc__ = "lossreduce's CPU stand-in: flash-attn was built without its CUDA kernels."

    def missing_kernel(name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            # Module attributes Python and inspect look up (__file__, __path__...).
            raise AttributeError(name)

        def missing(*_: object, **__: object) -> Any:
            raise FlashAttentionKernelMissingError(
                f"flash_attn_2_cuda.{name}: flash-attn's CUDA kernels are not built on this "
                "CPU machine; run SkyRL with trainer.flash_attn=false and "
                "trainer.remove_microbatch_padding=false"
            )

        return missing

    module.__getattr__ = missing_kernel  # type: ignore[method-assign]
    sys.modules["flash_attn_2_cuda"] = module


# -- 2. collectives -------------------------------------------------------------------


def _cpu_mesh(init_device_mesh: Callable[..., Any]) -> Callable[..., Any]:
    def on_cpu(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    return on_cpu


def _gloo_collectives() -> None:
    init_process_group = dist.init_process_group

    def gloo(backend: str | None = None, *, timeout: timedelta | None = None) -> None:
        # SkyRL's worker calls this with backend="cpu:gloo,cuda:nccl" and its timeout;
        # NCCL would be the backend of a device nobody has.
        del backend
        init_process_group(backend="gloo", timeout=timeout)

    dist.init_process_group = gloo  # type: ignore[assignment]
    dist.device_mesh.init_device_mesh = _cpu_mesh(dist.device_mesh.init_device_mesh)


# -- 3. devices -----------------------------------------------------------------------


def _returning(value: object, name: str) -> Callable[..., Any]:
    # One function object per replaced name: torch.compile's rule table keys torch's
    # functions by identity and refuses one object under two names.
    def answer(*_: object, **__: object) -> Any:
        return value

    answer.__name__ = answer.__qualname__ = f"cpu_{name}"
    return answer


def _cpu_devices() -> None:
    cuda = torch.cuda
    cuda.current_device = _returning("cpu", "current_device")
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(cuda, name, _returning(None, name))
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        setattr(cuda, name, _returning(0, name))
    cuda.mem_get_info = _returning((0, 0), "mem_get_info")

    def stay(self: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
        return self

    torch.Tensor.cuda = stay  # type: ignore[method-assign,assignment]


@torch.no_grad()
def _broadcast_non_persistent_buffers(model: torch.nn.Module, _loaded: dict[str, Any]) -> None:
    """Rank 0's non-persistent buffers (rotary ``inv_freq``...), which no state dict
    carries, on every rank: what SkyRL's helper of that name does, on CPU tensors."""
    for module in model.modules():
        for key in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            buffer = module._buffers.get(key)
            if buffer is None:
                continue
            value = (
                buffer.detach().clone()
                if dist.get_rank() == 0
                else torch.empty(buffer.shape, dtype=buffer.dtype)
            )
            dist.broadcast(value, src=0)
            module._buffers[key] = value
