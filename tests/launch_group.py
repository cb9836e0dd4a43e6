"""A framework launch the tests drive while it runs, in a process group of its own.

The launch's driver leads a new session, so the local Ray it starts (its GCS, raylet
and workers) joins the driver's process group. :class:`GroupLaunch` can then kill the
driver alone with SIGKILL, as a crash or an OOM killer would, wait for Ray to notice and
end, and end whatever of the group outlives a grace, so that no launch competes with the
next for the machine's cores and every test stops by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GroupLaunch", "end_group", "group_alive"]


@dataclass
class GroupLaunch:
    """One running (or finished) launch; its output goes to ``log``."""

    name: str
    log: Path
    process: subprocess.Popen[bytes]
    started: float
    ended: float | None = field(default=None)

    @classmethod
    def start(
        cls,
        name: str,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log: Path,
    ) -> GroupLaunch:
        """``command`` in the background, in a session of its own."""
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(command),
                cwd=cwd,
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(name, log, process, time.monotonic())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def check_running(self, waiting_for: str) -> None:
        """Fail, with the output's tail, if the driver has exited."""
        if self.process.poll() is not None:
            raise AssertionError(
                f"{self.name}: exited {self.process.returncode} before {waiting_for}:\n"
                f"{self.output()[-8000:]}"
            )

    def kill_driver(self) -> None:
        """SIGKILL the driver alone; then wait for its local Ray to notice and end, and
        end what is left of the group."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.ended = time.monotonic()
        self._end_group(grace=30.0)

    def wait(self, timeout: float) -> int:
        """The driver's exit status (within ``timeout`` seconds of now)."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.ended = time.monotonic()
            self._end_group(grace=10.0)
        return self.process.returncode

    def stop(self) -> None:
        """End the launch and its group, however far it got (a test's cleanup)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._end_group(grace=0.0)

    def _end_group(self, grace: float) -> None:
        end_group(self.process.pid, grace)


def end_group(pgid: int, grace: float) -> None:
    """Wait up to ``grace`` seconds for process group ``pgid`` to end by itself (Ray's
    processes end with their driver), then SIGKILL what is left and wait for it."""
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
        while group_alive(pgid):
            time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(_state(pid) not in ("Z", None) for pid in _members(pgid))


def _members(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                continue
    return pids


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]
