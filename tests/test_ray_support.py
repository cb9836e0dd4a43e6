"""The test harness's Ray reaper kills what a failed start leaves and nothing else."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lossreduce.trainer_worker.train.ray_start import (
    RAY_PACKAGE as _RAY_PACKAGE,
)
from lossreduce.trainer_worker.train.ray_start import (
    reap_ray_processes,
    start_timed_out,
)


def test_reaps_processes_spawned_from_rays_package_and_spares_others() -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ray_like = subprocess.Popen([*sleep, f"{_RAY_PACKAGE}core/src/ray/raylet/raylet"])
    other = subprocess.Popen(sleep)
    try:
        assert reap_ray_processes() >= 1
        assert ray_like.returncode is not None
        assert other.poll() is None
    finally:
        for proc in (ray_like, other):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("message", "slow"),
    [
        # What Ray 2.x raises when a raylet misses its fixed registration window.
        ("The current node timed out during startup. This could happen because ...", True),
        # What it raises when the head's GCS publishes its port after the wait ends.
        (
            "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc. "
            "The GCS server may have failed to start",
            True,
        ),
        ("Ray has not been started yet.", False),
        ("Address already in use", False),
    ],
)
def test_slow_starts_are_retried_and_other_failures_are_not(message: str, slow: bool) -> None:
    assert start_timed_out(RuntimeError(message)) is slow
