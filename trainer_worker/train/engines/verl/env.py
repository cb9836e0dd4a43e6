"""The process environment verl needs, set before ``verl`` is first imported.

verl picks its platform and loads external modules when it is imported, so a
process that runs verl's FSDP engine on CPU must have lossreduce's CPU platform
selected first (:data:`~lossreduce.trainer_worker.cpu_standins.verl.env.CPU_ENV`).
A process with CUDA keeps verl's own CUDA platform. No verl import here.
"""

from __future__ import annotations

import os
import sys

import torch

from lossreduce.trainer_worker.cpu_standins.verl.env import CPU_ENV

__all__ = ["QUIET_ENV", "prepare_verl_process"]

QUIET_ENV = {
    "VERL_LOGGING_LEVEL": "ERROR",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""No hub access (the policy is a local folder) and verl's logs at errors only."""


def prepare_verl_process() -> bool:
    """Set what this process needs before it imports verl; whether it runs on CPU.

    Raises RuntimeError when verl was already imported without the CPU platform on a
    machine without CUDA: its FSDP engine would not start.
    """
    cpu = not torch.cuda.is_available()
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if not cpu:
        return False
    if "verl" in sys.modules:
        if os.environ.get("VERL_PLATFORM") != CPU_ENV["VERL_PLATFORM"]:
            raise RuntimeError(
                "verl was imported before lossreduce could select its CPU platform; set "
                + " ".join(f"{k}={v}" for k, v in CPU_ENV.items())
                + " before importing verl"
            )
        return True
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    return True
