"""A CPU platform for verl, so its real engine workers run without a GPU.

verl 0.9.1 ships platforms for CUDA, ROCm and Ascend only. This module
registers ``cpu`` when imported: load it in every process with
``VERL_USE_EXTERNAL_MODULES=lossreduce.trainer_worker.cpu_standins.verl.platform``
and select it with ``VERL_PLATFORM=cpu`` (all of it: :data:`.env.CPU_ENV`). The device
module is ``torch.cpu`` plus the memory statistics verl logs (zeros); the
collective backend is gloo. verl's critic loads its value model with
``attn_implementation="flash_attention_2"`` whatever the model config says
(``verl.utils.model.load_valuehead_model``), which has no CPU kernel: here it loads
with the config's own attention (eager in the tests). Only CPU-only runs need it
(the tests, the bench); a GPU run never imports it. It imports nothing of
lossreduce beyond this.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import verl.utils.distributed as verl_distributed
import verl.utils.fsdp_utils as verl_fsdp_utils
import verl.utils.model as verl_model
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["PlatformCPU"]


def _zero(*_: object, **__: object) -> int:
    return 0


def _nothing(*_: object, **__: object) -> None:
    return None


def _device_module() -> Any:
    # torch.cpu lacks the memory statistics verl reads after every step.
    return SimpleNamespace(
        **{k: getattr(torch.cpu, k) for k in ("is_available", "synchronize", "device_count")},
        current_device=lambda: "cpu",
        get_device_name=lambda *_: "CPU",
        set_device=_nothing,
        empty_cache=_nothing,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        # verl's checkpoints save and restore the device generator beside the CPU one
        # (BaseCheckpointManager.get_rng_state / load_rng_state); here they are one generator.
        get_rng_state=lambda *_: torch.get_rng_state(),
        set_rng_state=lambda state, *_: torch.set_rng_state(state),
        max_memory_allocated=_zero,
        max_memory_reserved=_zero,
        memory_allocated=_zero,
        memory_reserved=_zero,
        reset_peak_memory_stats=_nothing,
        mem_get_info=lambda *_: (0, 0),
    )


def _gloo_process_group(timeout_second: int | None = None, backend: str | None = None) -> Any:
    # verl's default backend string is "cpu:gloo,<device>:<collective>", which torch
    # refuses when the device is the CPU ("cpu:gloo,cpu:gloo"): plain gloo instead.
    return _verl_init_process_group(timeout_second=timeout_second, backend=backend or "gloo")


# verl's Ray workers (main_ppo's) join torch.distributed through this function,
# imported by name after `import verl` has loaded this module.
_verl_init_process_group = getattr(
    verl_distributed.initialize_global_process_group_ray,
    "__wrapped__",
    verl_distributed.initialize_global_process_group_ray,
)
_gloo_process_group.__wrapped__ = _verl_init_process_group  # type: ignore[attr-defined]
verl_distributed.initialize_global_process_group_ray = _gloo_process_group


@dataclass
class _UnpinnedCPUOffloadPolicy(CPUOffloadPolicy):
    """FSDP2's CPU offload without pinned memory, which needs an accelerator."""

    def __post_init__(self) -> None:
        self.pin_memory = False


# verl's FSDP engine offloads a forward-only model (the reference policy) with
# CPUOffloadPolicy(pin_memory=True), imported from fsdp_utils after this module.
verl_fsdp_utils.CPUOffloadPolicy = _UnpinnedCPUOffloadPolicy


def _cpu_value_model(
    local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool
) -> Any:
    """verl's value model (a token-classification head of one label) with the attention
    its config names, as ``load_valuehead_model`` loads it but for flash attention."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        trust_remote_code=trust_remote_code,
    )


# verl's FSDP engine imports it from verl.utils.model when it builds a value model.
verl_model.load_valuehead_model = _cpu_value_model


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):  # type: ignore[misc]
    """CPU only: gloo collectives, no device memory to report."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._module  # type: ignore[no-any-return]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # Ray takes CPUs as num_cpus only (verl's default puts a non-GPU device's
        # share under resources=, which Ray refuses for 'CPU').
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
