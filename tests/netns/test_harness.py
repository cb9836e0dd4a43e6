"""The namespace network itself: isolated, faults as they say, and cleaned up."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.netns.harness import PREFIX, SUBNET, Network, remove_stale, run


def _namespaces() -> list[str]:
    return [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line]


def test_namespaces_are_isolated(network: Network) -> None:
    """Addresses of the test network exist only inside its namespaces: no default route,
    no route but the test subnet, nothing of it in the machine's own namespace."""
    hosts = [network.add_host(name) for name in ("a", "b")]
    for host in hosts:
        main = [line for line in network.routes(host) if "table" not in line.split()]
        assert all(line.startswith((f"{SUBNET}.0/24 ", "fe80::/64 ")) for line in main), main
    own = run(["ip", "-4", "addr"]).stdout + run(["ip", "route", "show", "table", "all"]).stdout
    assert f"{SUBNET}." not in own


def test_partition_and_reset_are_what_they_say(network: Network) -> None:
    """A partition drops packets silently (a connect gets no answer, not a refusal);
    a heal restores them; a reset makes the peer see ECONNRESET."""
    a, b = network.add_host("a"), network.add_host("b")
    listen = (
        f"import socket,sys,time\ns=socket.socket();s.bind(('{b.address}',7000));s.listen()\n"
        "print('up',flush=True)\nc,_=s.accept();c.recv(1);time.sleep(30)"
    )
    server = b.spawn("listen", ["python3", "-c", listen], ready="up")
    dial = (
        "import socket,time\nt=time.monotonic()\n"
        f"try:\n s=socket.create_connection(('{b.address}',7000),timeout=1.5);print('connected')\n"
        "except OSError as e:print(type(e).__name__)\n"
    )
    network.partition(b)
    assert a.python(dial).strip() == "TimeoutError"  # silence: no RST, no ICMP
    network.heal(b)
    keep = (
        f"import socket\ns=socket.create_connection(('{b.address}',7000),timeout=5);s.send(b'x')\n"
        "print('connected',flush=True)\ns.settimeout(10)\n"
        "try:\n s.recv(1)\nexcept OSError as e:print(type(e).__name__,flush=True)\n"
    )
    client = a.spawn("keep", ["python3", "-c", keep], ready="connected")
    deadline = time.monotonic() + 5
    while not b.connections(sport=7000) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert network.reset(b) == 1
    client.wait_for("ConnectionResetError", timeout_s=5)
    server.kill()


def test_close_removes_every_namespace_and_process(network: Network, tmp_path: Path) -> None:
    """Even with processes still running in them (a test that failed midway)."""
    other = Network(tmp_path)
    host = other.add_host("h")
    sleeper = host.spawn("sleep", ["sleep", "60"])
    assert sleeper.proc is not None
    names = [n for n in _namespaces() if n.startswith(other.tag + "-")]
    assert len(names) == 2  # the switch and the host
    other.close()
    assert sleeper.proc.poll() is not None
    assert not [n for n in _namespaces() if n.startswith(other.tag + "-")]


def test_stale_namespaces_of_a_dead_run_are_removed(network: Network) -> None:
    """A run killed before its cleanup leaves namespaces named after its pid; the next
    run removes them, and leaves those of live runs (this one's) alone."""
    finished = subprocess.Popen(["true"])  # its pid is no one's once reaped
    finished.wait()
    stale = f"{PREFIX}{finished.pid}-1-sw"
    run(["ip", "netns", "add", stale])
    try:
        assert stale in remove_stale()
        assert stale not in _namespaces()
        assert network.switch in _namespaces()
    finally:
        run(["ip", "netns", "del", stale], check=False)
