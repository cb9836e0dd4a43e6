"""What ``test_areal_single_controller.py`` launches: AReaL's single-controller mode,
``python single_controller_launch.py --config single_controller.yaml``, no launcher and
no ``torchrun``.

The controller (that one process) starts everything else through AReaL's local
scheduler: two RPC workers that build the actor, a rollout worker that launches the
inference server, and the eval-rollout worker it forks. Nothing of AReaL is changed.
The one seam is the rollout worker's environment, a scheduler option of AReaL's config
(``rollout.scheduling_spec[0].env_vars``): AReaL's vLLM backend starts its server as
``python3 -m areal.engine.vllm_ext.areal_vllm_server FLAGS``, found on the worker's
``PATH``, and this helper puts a ``python3`` first on that PATH which runs
``cpu_vllm_server.py`` with those flags (and the test environment's interpreter for any
other command). vLLM cannot run here (``rollout_server.py`` says why).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.trainer_worker.integrations.areal.trainer_loop import HERE, ROOT

LAUNCH = HERE / "single_controller_launch.py"
CONFIG = HERE / "single_controller.yaml"
SERVER = HERE / "cpu_vllm_server.py"
VLLM_MODULE = "areal.engine.vllm_ext.areal_vllm_server"
"""The module AReaL's vLLM backend runs as the inference server (``vLLMConfig``)."""

SHIM = """#!/bin/sh
# AReaL's rollout worker starts vLLM as `python3 -m {module} FLAGS`: run the CPU rollout
# server with those flags instead; any other python3 command is the test environment's.
if [ "$1" = "-m" ] && [ "$2" = "{module}" ]; then
    shift 2
    exec {python} {server} "$@"
fi
exec {python} "$@"
"""


def save_python3(folder: Path) -> Path:
    """A folder holding the ``python3`` of the rollout worker's PATH (see the module doc)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python3"
    shim.write_text(
        SHIM.format(
            module=VLLM_MODULE,
            python=shlex.quote(sys.executable),
            server=shlex.quote(str(SERVER)),
        )
    )
    shim.chmod(0o755)
    return folder


@dataclass
class ControllerRun:
    """One single-controller launch: the controller's result, what the rollout server
    served (its log) and the weight versions it received."""

    done: subprocess.CompletedProcess[str]
    server_log: dict[str, Any]
    weights: dict[int, dict[str, Any]]  # version -> state dict
    worker_logs: dict[str, str]  # role -> that role's log, as AReaL's scheduler wrote it


def launch(
    work: Path,
    *,
    model: Path,
    prompts: Path,
    env: dict[str, str],
    overrides: tuple[str, ...] = (),
    timeout_s: float = 600,
) -> ControllerRun:
    """``single_controller_launch.py`` (LossReduce's trainer) in ``work``;
    ``env`` is added to the controller's environment, which the scheduler passes on to
    every worker it starts."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    keep = work / "received"
    fileroot = work / "fileroot"
    bin_dir = save_python3(work / "bin")
    args = [
        sys.executable,
        str(LAUNCH),
        "--config",
        str(CONFIG),
        f"actor.path={model}",
        f"train_dataset.path={prompts}",
        f"cluster.fileroot={fileroot}",
        f"cluster.name_resolve.nfs_record_root={work / 'name_resolve'}",
        f"+rollout.scheduling_spec.0.env_vars.PATH={bin_dir}{os.pathsep}{os.environ['PATH']}",
        f"+rollout.scheduling_spec.0.env_vars.KEEP_DIR={keep}",
        *overrides,
    ]
    # Single-controller mode is AReaL's default: AREAL_SPMD_MODE unset. The run's
    # LOSSREDUCE_* settings are exactly ``env`` (and the overrides), none of the caller's.
    base = {
        k: v
        for k, v in os.environ.items()
        if k != "AREAL_SPMD_MODE" and not k.startswith("LOSSREDUCE_")
    }
    full_env = {
        **base,
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
        # AReaL's caches (kernels, Triton, vLLM): in the test's folder, not /tmp/areal-<user>.
        "AREAL_CACHE_DIR": str(work / "areal-cache"),
        **env,
    }
    done = _run(args, work, full_env, timeout_s)
    log_file = keep / "log.json"
    server_log = json.loads(log_file.read_text()) if log_file.exists() else {}
    weights = {
        int(p.stem[1:]): torch.load(p, weights_only=True) for p in sorted(keep.glob("v*.pt"))
    }
    worker_logs = {p.stem: p.read_text() for p in (fileroot / "logs").rglob("*.log")}
    return ControllerRun(done, server_log, weights, worker_logs)


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """The controller in a session of its own, its output in files (a worker that outlives
    it keeps a pipe open, and reading one would wait for that worker); whatever of its
    session is left when it exits or times out (a worker after a crash) is killed."""
    out_path, err_path = cwd / "controller.out", cwd / "controller.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        process = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout_s)
            note = ""
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode = process.wait()
            note = f"\n[the controller ran past {timeout_s} s and was killed]"
        with contextlib.suppress(ProcessLookupError):  # nothing of the session is left
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(
        args, returncode, out_path.read_text(), err_path.read_text() + note
    )
