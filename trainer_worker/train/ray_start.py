"""Local Ray starts on a slow machine: recognise a start that was only too slow, and
reap what a failed start left running.

On a loaded machine a head's GCS sometimes publishes its port after Ray's wait
for it ends (``RuntimeError: Timed out waiting for file .../gcs_server_port_...``),
or a raylet misses Ray's fixed 30 s registration window (a bare ``Exception``),
with the GCS and raylet it spawned still running. The driver of ``lossreduce
train`` (and the test harness) kills and reaps those and tries again.
"""

from __future__ import annotations

import gc
import os
import subprocess
from pathlib import Path

import ray

__all__ = ["LOCAL_START_ATTEMPTS", "RAY_PACKAGE", "reap_ray_processes", "start_timed_out"]

LOCAL_START_ATTEMPTS = 3
"""Local starts tried before a slow machine's failure is the run's failure."""

_SLOW_START = ("timed out during startup", "Timed out waiting for file")
"""Ray's words for a raylet that missed its registration window, and for a GCS (or
raylet) that published its port file too late."""

RAY_PACKAGE = str(Path(ray.__file__).parent) + os.sep
"""Ray's package folder with its separator, so a sibling such as ``raydp`` does not match."""


def reap_ray_processes() -> int:
    """Kill and wait for every process this interpreter spawned from Ray's package; how many."""
    reaped = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): some heap objects warn when asked for __class__.
        if not issubclass(type(obj), subprocess.Popen) or obj.returncode is not None:
            continue
        args = obj.args if isinstance(obj.args, list | tuple) else [obj.args]
        if not any(RAY_PACKAGE in str(arg) for arg in args):
            continue
        if obj.poll() is None:
            obj.kill()
        obj.wait()
        reaped += 1
    return reaped


def start_timed_out(err: Exception) -> bool:
    """Whether ``err`` is Ray's error for a start that was too slow (a loaded machine,
    not a broken test): a raylet that missed its registration window, or a GCS whose
    port file came too late."""
    return any(words in str(err) for words in _SLOW_START)
