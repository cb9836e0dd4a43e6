"""The server side of each contender of ``lossreduce bench``, run by the driver.

- the ``bare-echo`` reference (:mod:`lossreduce.bench.echo`), in its own
  process too;
- the coordinator: ``lossreduce serve`` in its own process, so its CPU time is
  its own and can be read from ``/proc`` (:func:`start_serve` launches it and
  waits for its health check; the reliability tests start theirs with it too);
- one TCPStore server (torch's libuv store) for the TCPStore contender and
  gloo's rendezvous;
- a local Ray cluster hosting the Ray-actor coordinator.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from lossreduce.ports import LOOPBACK, free_port

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = [
    "SERVE_COMMAND",
    "BenchServerError",
    "CoordinatorProcess",
    "EchoProcess",
    "process_cpu_ns",
    "start_serve",
    "start_store",
    "wait_serving",
]

SERVE_COMMAND = (sys.executable, "-m", "lossreduce.cli", "serve")
"""``lossreduce serve`` run by this interpreter (no console script on PATH needed)."""

_HEALTH_POLL_S = 0.05


class BenchServerError(RuntimeError):
    """A server (``lossreduce serve``, a contender's) did not start."""


def wait_serving(
    proc: subprocess.Popen[bytes], target: str, timeout_s: float, log: Callable[[], str]
) -> None:
    """Block until ``lossreduce serve`` (``proc``) answers SERVING on ``target``.

    Raises :class:`BenchServerError` with what it printed (``log()``) if it exits
    first or is not SERVING within ``timeout_s``; the process is left as it is.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchServerError(
                f"lossreduce serve on {target} exited with {proc.returncode}:\n{log()}"
            )
        # A channel per poll: grpcio 1.72 (the floor) keeps a channel whose first connect was
        # refused failing fast for a minute or more, long after the server listens.
        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
        time.sleep(_HEALTH_POLL_S)
    raise BenchServerError(
        f"lossreduce serve on {target} not SERVING after {timeout_s} s:\n{log()}"
    )


def start_serve(
    port: int,
    args: Sequence[str],
    *,
    log: IO[bytes],
    log_text: Callable[[], str],
    cwd: Path | None = None,
    timeout_s: float = 60.0,
) -> subprocess.Popen[bytes]:
    """Start ``lossreduce serve --host 127.0.0.1 --port PORT ARGS`` and wait until it
    is SERVING. Its output goes to ``log`` (a file, not a pipe: a chatty server must
    never block on a full pipe); ``log_text()`` reads it back for errors. A server
    that does not come up is killed and :class:`BenchServerError` raised."""
    return _start(
        [*SERVE_COMMAND, "--host", LOOPBACK, "--port", str(port), *args],
        port,
        log=log,
        log_text=log_text,
        cwd=cwd,
        timeout_s=timeout_s,
    )


def _start(
    command: Sequence[str],
    port: int,
    *,
    log: IO[bytes],
    log_text: Callable[[], str],
    cwd: Path | None,
    timeout_s: float,
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_serving(proc, f"{LOOPBACK}:{port}", timeout_s, log_text)
    except BenchServerError:
        proc.kill()
        proc.wait()
        raise
    return proc


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


class _ServerProcess:
    """A gRPC server as a child process on a free loopback port, its output in a
    temporary file."""

    def __init__(self, startup_timeout_s: float) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="lossreduce-bench-")
        self.port = free_port()
        self.target = f"{LOOPBACK}:{self.port}"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 -- lives as long as the server
        try:
            self._proc = self._launch(startup_timeout_s)
        except BenchServerError:
            self._log.close()
            self._dir.cleanup()
            raise
        self.pid = self._proc.pid

    def _launch(self, timeout_s: float) -> subprocess.Popen[bytes]:
        raise NotImplementedError

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


class CoordinatorProcess(_ServerProcess):
    """``lossreduce serve`` as a child process on a free loopback port."""

    def __init__(self, extra_args: Sequence[str] = (), startup_timeout_s: float = 60.0) -> None:
        self._extra_args = tuple(extra_args)
        super().__init__(startup_timeout_s)

    def _launch(self, timeout_s: float) -> subprocess.Popen[bytes]:
        # As shipped: metrics and the journal on (a throwaway journal file).
        args = [
            "--metrics-port",
            "0",
            "--journal",
            str(Path(self._dir.name) / "journal.sqlite3"),
            *self._extra_args,
        ]
        return start_serve(self.port, args, log=self._log, log_text=self.log, timeout_s=timeout_s)


class EchoProcess(_ServerProcess):
    """The ``bare-echo`` reference server (:mod:`lossreduce.bench.echo`)."""

    def __init__(self, startup_timeout_s: float = 60.0) -> None:
        super().__init__(startup_timeout_s)

    def _launch(self, timeout_s: float) -> subprocess.Popen[bytes]:
        from lossreduce.bench.echo import ECHO_MODULE

        return _start(
            [sys.executable, "-m", ECHO_MODULE, "--port", str(self.port)],
            self.port,
            log=self._log,
            log_text=self.log,
            cwd=None,
            timeout_s=timeout_s,
        )
