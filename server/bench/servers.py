"""The server side of each contender of ``lossreduce bench``, run by the driver.

- the coordinator: ``lossreduce serve`` in its own process, so its CPU time is
  its own and can be read from ``/proc``;
- one TCPStore server (torch's libuv store) for the TCPStore contender and
  gloo's rendezvous;
- a local Ray cluster hosting the Ray-actor coordinator.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = [
    "BenchServerError",
    "CoordinatorProcess",
    "free_port",
    "process_cpu_ns",
    "start_store",
]


class BenchServerError(RuntimeError):
    """A contender's server did not start."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def process_cpu_ns(pid: int) -> int:
    """CPU time (user + system) of every live thread of ``pid``, in ns.

    ``/proc/PID/task/*/schedstat`` counts in nanoseconds, where ``/proc/PID/stat``
    counts in 10 ms ticks, too coarse for a few hundred contributions.
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between listing and reading
    return total


def start_store(host: str = "127.0.0.1") -> TCPStore:
    """Start a TCPStore server on a free port (read it back from ``.port``)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(
        host,
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
        use_libuv=True,
    )


class CoordinatorProcess:
    """``lossreduce serve`` as a child process on a free loopback port."""

    def __init__(self, extra_args: Sequence[str] = (), startup_timeout_s: float = 60.0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="lossreduce-bench-")
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "lossreduce.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            # As shipped: metrics and the journal on (a throwaway journal file).
            "--metrics-port",
            "0",
            "--journal",
            str(Path(self._dir.name) / "journal.sqlite3"),
            *extra_args,
        ]
        # A file, not a pipe: a chatty server must never block on a full pipe mid-run.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 -- lives as long as the server
        self._proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.pid = self._proc.pid
        self._wait_serving(startup_timeout_s)

    def _wait_serving(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise BenchServerError(
                        f"lossreduce serve exited with {self._proc.returncode}:\n{self.log()}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                except grpc.RpcError:
                    time.sleep(0.1)
                    continue
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                time.sleep(0.1)
        self.stop()
        raise BenchServerError(f"lossreduce serve on {self.target} not SERVING after {timeout_s} s")

    def log(self) -> str:
        """What the server printed so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def cpu_ns(self) -> int:
        return process_cpu_ns(self.pid)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        self._dir.cleanup()
