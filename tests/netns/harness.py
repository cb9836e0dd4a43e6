"""A small network of Linux network namespaces for the network-fault tests.

Topology: one "switch" namespace holding a bridge, and one namespace per host
(the coordinator's, and one per node), each joined to the bridge by a veth
pair. Hosts get addresses in ``10.213.0.0/24`` that exist only inside these
namespaces; no namespace has a default route and the machine's own
namespace gets neither an address nor a route there, so no packet of a test
can leave the namespaces.

Faults, as a cluster has them:

- :meth:`Network.partition`: take the host's port on the switch down. Both
  directions' packets are dropped silently (no reset, no ICMP): only
  keepalives and deadlines can tell.
- :meth:`Network.heal`: bring the port back up.
- :meth:`Network.reset`: kill the host's TCP connections to the other hosts
  (``ss -K``): the kernel sends a reset to each peer (which arrives only
  while the link is up), as a rebooted switch or a crashed NAT would.

Processes run inside a namespace through ``ip netns exec``; every one started
here is SIGKILLed, and every namespace deleted, by :meth:`Network.close`
(called by the fixture, and at interpreter exit for whatever a crashed test
left). Namespaces of earlier runs whose process is gone are removed by
:func:`remove_stale`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

PREFIX = "lrnf-"
"""Every namespace this harness creates starts with it (``lrnf-<pid>-<n>-<host>``)."""
SUBNET = "10.213.0"
"""The /24 the hosts live on; only inside the namespaces."""
COMMAND_TIMEOUT_S = 10.0
"""Bound of one ``ip``/``ss`` command."""
READY_TIMEOUT_S = 60.0
"""Bound of a process's start (two shared cores: python and grpc imports are slow)."""

_live: set[Network] = set()
_counter = itertools.count(1)


class NetnsError(RuntimeError):
    """An ``ip`` or ``ss`` command failed, or a process in a namespace did not start."""


def run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command (bounded in time); raise NetnsError naming it when it fails."""
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(args)} did not finish in {COMMAND_TIMEOUT_S} s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or None when they can (tried for real)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root; run the tests as root)"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (Debian package iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    done = run(["ip", "netns", "add", probe], check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    try:
        veth = run(
            ["ip", "-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb"],
            check=False,
        )
        if veth.returncode != 0:
            return f"veth pairs cannot be created: {veth.stderr.strip()}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """SIGKILL whatever still runs in namespace ``name``, then delete it."""
    pids = run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run(["ip", "netns", "del", name], check=False)


def remove_stale() -> list[str]:
    """Delete namespaces of earlier runs (our prefix, their process gone); return their names."""
    removed = []
    listing = run(["ip", "netns", "list"], check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{re.escape(PREFIX)}(\d+)-.*", name)
        if match and not _alive(int(match.group(1))):
            _kill_namespace(name)
            removed.append(name)
    return removed


class NsProcess:
    """One process inside a namespace; its output goes to ``log_path`` (stdout lines to
    :meth:`line` too, when ``pipe`` is set), and it can be SIGKILLed and started again."""

    def __init__(
        self, host: Host, name: str, command: Sequence[str], log_path: Path, *, pipe: bool = False
    ) -> None:
        self.host = host
        self.name = name
        self.command = list(command)
        self.log_path = log_path
        self.pipe = pipe
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0
        self._lines: queue.Queue[str] = queue.Queue()

    def start(self, ready: str | None = None) -> NsProcess:
        """Start the process; with ``ready``, return once its log shows that text."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} already runs"
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.host.namespace, *self.command],
                stdin=subprocess.PIPE if self.pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.pipe else log,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.starts += 1
        if self.pipe:
            assert self.proc.stdout is not None
            threading.Thread(
                target=self._pump, args=(self.proc.stdout,), name=f"pump-{self.name}", daemon=True
            ).start()
        if ready is not None:
            self.wait_for(ready, offset)
        return self

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)

    def wait_for(self, text: str, offset: int = 0, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log()[offset:]:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise NetnsError(
                    f"{self.name} in {self.host.namespace} exited with {self.proc.returncode} "
                    f"before printing {text!r}:\n{self.log()[offset:]}"
                )
            time.sleep(0.05)
        raise NetnsError(
            f"{self.name} in {self.host.namespace} did not print {text!r} within "
            f"{timeout_s} s:\n{self.log()[offset:]}"
        )

    def send(self, line: str) -> None:
        assert self.proc is not None, f"{self.name} was not started"
        assert self.proc.stdin is not None, f"{self.name} has no stdin pipe"
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self, timeout_s: float) -> str:
        """The next stdout line; raise NetnsError (with the log) after ``timeout_s``."""
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise NetnsError(
                f"{self.name}: no output line within {timeout_s} s:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL (no goodbye) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=COMMAND_TIMEOUT_S)
        if self.proc is not None:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _v4(endpoint: str) -> str:
    """``[::ffff:10.213.0.10]:50051`` (a dual-stack socket's view) -> ``10.213.0.10:50051``."""
    return re.sub(r"^\[::ffff:([0-9.]+)\]", r"\1", endpoint)


class Host:
    """One namespace on the switch: ``address`` on its ``eth0``, port ``port`` on the bridge."""

    def __init__(self, network: Network, name: str, index: int) -> None:
        self.network = network
        self.name = name
        self.namespace = f"{network.tag}-{name}"
        self.address = f"{SUBNET}.{10 + index}"
        self.port = f"p{index}"

    def spawn(
        self, name: str, command: Sequence[str], *, pipe: bool = False, ready: str | None = None
    ) -> NsProcess:
        """Start ``command`` in this host's namespace (tracked: killed at close)."""
        process = NsProcess(
            self, name, command, self.network.workdir / f"{self.name}-{name}.log", pipe=pipe
        )
        self.network.processes.append(process)
        return process.start(ready)

    def connections(self, *, sport: int | None = None, dport: int | None = None) -> list[str]:
        """Established TCP connections in this namespace as ``local->peer`` (``addr:port``),
        those on local port ``sport`` or to remote port ``dport``."""
        where = [f"( sport = :{sport} )"] if sport is not None else []
        where += [f"( dport = :{dport} )"] if dport is not None else []
        out = run(
            ["ip", "netns", "exec", self.namespace, "ss", "-Htn", "state", "established", *where]
        ).stdout
        return [
            f"{_v4(cols[-2])}->{_v4(cols[-1])}" for cols in map(str.split, out.splitlines()) if cols
        ]

    def python(self, code: str) -> str:
        """Run a short ``python -c`` in this namespace; its stdout."""
        return run(["ip", "netns", "exec", self.namespace, sys.executable, "-c", code]).stdout


class Network:
    """The switch and its hosts; :meth:`close` removes everything it made."""

    def __init__(self, workdir: Path) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.workdir = workdir
        self.hosts: list[Host] = []
        self.processes: list[NsProcess] = []
        self.switch = f"{self.tag}-sw"
        _live.add(self)
        self._namespaces: list[str] = []
        self._add_namespace(self.switch)
        self._sw(["link", "add", "br0", "type", "bridge"])
        self._sw(["link", "set", "br0", "up"])

    def _add_namespace(self, name: str) -> None:
        run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _sw(self, args: Sequence[str]) -> None:
        run(["ip", "-n", self.switch, *args])

    def add_host(self, name: str) -> Host:
        host = Host(self, name, len(self.hosts))
        self._add_namespace(host.namespace)
        run(
            [
                "ip",
                "link",
                "add",
                "name",
                "eth0",
                "netns",
                host.namespace,
                "type",
                "veth",
                "peer",
                "name",
                host.port,
                "netns",
                self.switch,
            ]
        )
        self._sw(["link", "set", host.port, "master", "br0"])
        self._sw(["link", "set", host.port, "up"])
        run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        run(["ip", "-n", host.namespace, "link", "set", "eth0", "up"])
        self.hosts.append(host)
        return host

    def partition(self, host: Host) -> None:
        """Cut ``host`` off silently: its switch port drops every packet, both ways."""
        self._sw(["link", "set", host.port, "down"])

    def heal(self, host: Host) -> None:
        self._sw(["link", "set", host.port, "up"])

    def reset(self, host: Host) -> int:
        """Kill ``host``'s TCP connections to the other hosts; returns how many it had."""
        out = run(
            ["ip", "netns", "exec", host.namespace, "ss", "-HKtn", "dst", f"{SUBNET}.0/24"]
        ).stdout
        return len([line for line in out.splitlines() if line.strip()])

    def routes(self, host: Host) -> list[str]:
        out = run(["ip", "-n", host.namespace, "route", "show", "table", "all"]).stdout
        return [line for line in out.splitlines() if line.strip()]

    def close(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                process.kill()
        for name in reversed(self._namespaces):
            _kill_namespace(name)
        self._namespaces.clear()
        _live.discard(self)


@atexit.register
def _close_all() -> None:
    for network in list(_live):
        network.close()
