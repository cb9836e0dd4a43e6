"""The test harness's Ray reaper kills what a failed start leaves and nothing else."""

from __future__ import annotations

import subprocess
import sys

from tests.ray_support import _RAY_PACKAGE, reap_ray_processes


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
