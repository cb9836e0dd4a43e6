"""``main_ppo`` launches the test drives while they run: killed with SIGKILL once a
checkpoint is written, or started next to another one.

Each launch runs in a session of its own (its driver leads the process group, and
the local Ray it starts joins it), writes its output to ``<name>.log`` and verl's
file logger to ``<name>.jsonl`` in its folder, and keeps its temporary files (the
coordinator actor's journal among them) in ``<folder>/tmp``; Ray's session
directory stays in the system's temp dir (its socket paths must stay short).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lossreduce.trainer_worker.cpu_standins.verl.launch import (
    Launch,
    logged_steps,
    main_ppo_env,
)
from tests.launch_group import end_group

__all__ = ["CLAIMED", "Background", "checkpoint_of", "start"]

CLAIMED = re.compile(
    r"lossreduce: run '(?P<run>[^']+)' claimed job '(?P<job>[^']+)' group '(?P<group>[^']+)' "
    r"from round (?P<step>\d+)(?P<took_over>, taken over)?"
)
"""The line the trainer mode prints once its actor has claimed the run's group."""
TRACKER = "latest_checkpointed_iteration.txt"
"""verl's record of its newest complete checkpoint, in ``trainer.default_local_dir``."""


def checkpoint_of(folder: Path) -> Path:
    """Where a launch in ``folder`` keeps verl's checkpoints (``trainer.default_local_dir``)."""
    return folder / "checkpoints"


@dataclass
class Background:
    """One running (or finished) ``main_ppo`` launch."""

    name: str
    folder: Path
    process: subprocess.Popen[bytes]
    started: float
    ended: float | None = field(default=None)

    @property
    def log(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def metrics(self) -> Path:
        return self.folder / f"{self.name}.jsonl"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def claim(self) -> re.Match[str] | None:
        """The launch's claim line, once printed."""
        return CLAIMED.search(self.output())

    def _check_running(self, waiting_for: str) -> None:
        if self.process.poll() is not None:
            raise AssertionError(
                f"{self.name}: main_ppo exited {self.process.returncode} before {waiting_for}:\n"
                f"{self.output()[-8000:]}"
            )

    def wait_for_claim(self, timeout: float) -> re.Match[str]:
        """The claim line, waiting for it while the launch runs."""
        deadline = time.monotonic() + timeout
        while (found := self.claim()) is None:
            self._check_running("its claim")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no claim within {timeout:g} s")
            time.sleep(0.5)
        return found

    def wait_for_checkpoint(self, step: int, timeout: float) -> None:
        """Return as soon as verl's tracker names checkpoint ``step`` (written last, after
        the whole checkpoint): the driver is between steps then."""
        tracker = checkpoint_of(self.folder) / TRACKER
        deadline = time.monotonic() + timeout
        while True:
            text = tracker.read_text().strip() if tracker.exists() else ""
            if text and int(text) >= step:
                if int(text) > step:
                    raise AssertionError(f"{self.name}: checkpoint {text} already, not {step}")
                return
            self._check_running(f"checkpoint {step}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no checkpoint {step} within {timeout:g} s")
            time.sleep(0.05)

    def kill_driver(self) -> None:
        """SIGKILL the driver (``main_ppo``) alone, as a crash or an OOM killer would; then
        wait for its local Ray to notice and end, and end what is left of the group."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.ended = time.monotonic()
        self._end_group(grace=30.0)

    def wait(self, timeout: float) -> Launch:
        """How the launch ended (within ``timeout`` seconds of now)."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.ended = time.monotonic()
            self._end_group(grace=10.0)
        return Launch(self.process.returncode, self.output(), logged_steps(self.metrics))

    def seconds(self) -> float:
        """From the start to the driver's exit."""
        assert self.ended is not None, "the launch still runs"
        return self.ended - self.started

    def stop(self) -> None:
        """End the launch and its group, however far it got (a test's cleanup)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._end_group(grace=0.0)

    def _end_group(self, grace: float) -> None:
        # Ray's own processes end with their driver; whatever outlives the grace is ended
        # here, so no launch competes with the next for the machine's two cores.
        end_group(self.process.pid, grace)


def start(name: str, folder: Path, args: list[str]) -> Background:
    """``python -m verl.trainer.main_ppo *args`` in ``folder``, in the background."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "tmp"
    tmp.mkdir(exist_ok=True)
    env = main_ppo_env(folder / f"{name}.jsonl")
    env["RAY_TMPDIR"] = tempfile.gettempdir()
    env["TMPDIR"] = str(tmp)
    with (folder / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "verl.trainer.main_ppo", *args],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Background(name, folder, process, time.monotonic())
