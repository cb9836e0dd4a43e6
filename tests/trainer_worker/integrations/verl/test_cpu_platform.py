"""verl's own checkpoint code on the CPU platform: what a resumed launch calls first.

A relaunch with ``trainer.resume_mode=auto`` restores the generators in verl's
``load_checkpoint`` before any round, through the platform's device module
(``get_torch_device().set_rng_state``); a device module without it crashed there.
"""

from __future__ import annotations

import os
import subprocess
import sys

from lossreduce.trainer_worker.cpu_standins.verl.env import CPU_ENV

# In a fresh process: verl picks its platform on first import, from the environment.
ROUND_TRIP = """
import torch
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
from verl.utils.device import get_device_name

state = BaseCheckpointManager.get_rng_state()
first = torch.rand(4)
BaseCheckpointManager.load_rng_state(state)
assert torch.equal(torch.rand(4), first), "the restored generator drew other numbers"
print(get_device_name(), sorted(state))
"""


def test_verl_saves_and_restores_the_generators_on_the_cpu_platform() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP],
        env={**os.environ, **CPU_ENV, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    device, keys = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert device == "cpu"
    assert "'cpu'" in keys
