"""The environment that selects verl's CPU stand-ins, set before ``verl`` is imported.

verl picks its platform and loads ``VERL_USE_EXTERNAL_MODULES`` when it is itself
imported, so these values must be in a process's environment first. This module imports
no verl (the train job reads it before it imports verl).
"""

from __future__ import annotations

__all__ = ["CPU_ENV", "PLATFORM_MODULE", "ROLLOUT_MODULE"]

PLATFORM_MODULE = "lossreduce.trainer_worker.cpu_standins.verl.platform"
"""verl's CPU platform (:mod:`.platform`), by the name verl imports it by."""
ROLLOUT_MODULE = "lossreduce.trainer_worker.cpu_standins.verl.rollout"
"""The CPU rollout (:mod:`.rollout`), by the name verl imports it by."""

CPU_ENV = {
    "VERL_PLATFORM": "cpu",
    # verl registers its FSDP engine for cuda/npu only; the engine itself runs on CPU.
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_USE_EXTERNAL_MODULES": PLATFORM_MODULE,
}
"""What a process needs before it imports verl to run verl's FSDP engine on CPU."""
