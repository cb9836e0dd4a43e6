"""Load processes of ``lossreduce bench``: where the ranks run.

The driver starts one set of load processes per world size; each hosts a
slice of the ranks of every contender that shares processes (all but
``OWN_PROCESSES`` of :mod:`lossreduce.bench.run`), so contenders can be
interleaved round by round on the same processes. The driver sends ``("round", contender,
step)`` over a pipe; the process runs its ranks' contributions, stamps the
start and end with ``time.perf_counter_ns`` (CLOCK_MONOTONIC, comparable
across processes) and the process's CPU time around them, checks the sums
outside the stamped window, and answers ``("ok", start_ns, end_ns, cpu_ns)``.

Load processes come from a ``forkserver`` that has already imported torch and
grpc, so starting 64 of them costs a fork each rather than an interpreter and
a torch import each; gRPC and Ray are only ever used after the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from lossreduce.bench.contenders import (
    CALL_TIMEOUT_S,
    BareEchoRanks,
    BareStreamRanks,
    CoordinatorStreamRanks,
    CoordinatorUnaryRanks,
    Endpoints,
    GlooRank,
    HierarchicalEchoRanks,
    HierarchicalRanks,
    RankSide,
    TCPStoreRanks,
)
from lossreduce.bench.workload import check_sums, expected_sums

__all__ = [
    "CONTENDERS",
    "ECHO",
    "HIERARCHICAL",
    "BenchHostError",
    "HostPlan",
    "HostPool",
    "host_main",
    "split_ranks",
]

RankSideFactory = Callable[[Endpoints, Sequence[int], int], RankSide]


def _ray_ranks(endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> RankSide:
    # Imported lazily: only the load processes that host Ray ranks pay for Ray.
    from lossreduce.bench.ray_contender import RayRanks

    return RayRanks(endpoints, ranks, world_size)


CONTENDERS: dict[str, RankSideFactory] = {
    "coordinator-stream": CoordinatorStreamRanks,
    "coordinator-unary": CoordinatorUnaryRanks,
    "coordinator-hierarchical": HierarchicalRanks,
    "bare-stream": BareStreamRanks,
    "bare-echo": BareEchoRanks,
    "hierarchical-echo": HierarchicalEchoRanks,
    "gloo": GlooRank,
    "tcpstore": TCPStoreRanks,
    "ray-actor": _ray_ranks,
}
"""Every contender by name, in report order."""

HIERARCHICAL: frozenset[str] = frozenset({"coordinator-hierarchical", "hierarchical-echo"})
"""Contenders whose ranks come in whole nodes behind node agents."""

ECHO: frozenset[str] = frozenset({"bare-echo", "hierarchical-echo"})
"""The references served by the echo server instead of the coordinator."""

_PRELOAD = ["torch", "torch.distributed", "grpc", "lossreduce.bench.hosts"]


class BenchHostError(RuntimeError):
    """A load process failed or did not answer in time."""


def split_ranks(world_size: int, processes: int) -> list[tuple[int, ...]]:
    """Ranks ``0..world_size-1`` in contiguous, near-equal blocks over ``processes``."""
    if world_size < 1 or processes < 1:
        raise ValueError(f"world_size={world_size} and processes={processes} must be >= 1")
    processes = min(processes, world_size)
    base, extra = divmod(world_size, processes)
    blocks: list[tuple[int, ...]] = []
    start = 0
    for index in range(processes):
        size = base + (1 if index < extra else 0)
        blocks.append(tuple(range(start, start + size)))
        start += size
    return blocks


@dataclass(frozen=True)
class HostPlan:
    """What one load process hosts (pickled to it at start)."""

    index: int
    world_size: int
    endpoints: Endpoints
    ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Contender name -> the ranks this process hosts for it (may be empty)."""


async def _recv(conn: Connection) -> object:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), on_readable)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


def _serve(plan: HostPlan, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
    sides: dict[str, RankSide] = {}
    try:
        for name, ranks in plan.ranks.items():
            if ranks:
                sides[name] = CONTENDERS[name](plan.endpoints, ranks, plan.world_size)
        conn.send(("ready",))
        while True:
            # The loop runs while the process waits, so the async sides' connections
            # are served between rounds; a blocking side is called with no loop
            # running in this thread, as a training loop calls the blocking client.
            message = loop.run_until_complete(_recv(conn))
            assert isinstance(message, tuple)
            if message[0] == "close":
                break
            _, name, step = message
            side = sides[name]
            # Before the stamp: every load process does this at the same moment, so it
            # never competes for the CPU with another process's measured round.
            expected = expected_sums(plan.world_size, step)
            cpu = time.process_time_ns()
            start = time.perf_counter_ns()
            received = side.run_round(step)
            if inspect.isawaitable(received):
                received = loop.run_until_complete(received)
            end = time.perf_counter_ns()
            cpu = time.process_time_ns() - cpu
            if side.checked:
                for rank, sums in zip(plan.ranks[name], received, strict=True):
                    check_sums(name, rank, step, sums, expected, exact=side.exact)
            conn.send(("ok", start, end, cpu))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        for side in sides.values():
            closing = side.close()
            if inspect.isawaitable(closing):
                loop.run_until_complete(closing)


def host_main(plan: HostPlan, conn: Connection) -> None:
    """Entry point of one load process."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        _serve(plan, conn, loop)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


class HostPool:
    """The driver's handle on the load processes of one world size."""

    def __init__(self, plans: Sequence[HostPlan]) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.plans = tuple(plans)
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        for plan in self.plans:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=host_main, args=(plan, child), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def _collect(
        self, hosts: Sequence[int], what: str, timeout_s: float
    ) -> list[tuple[object, ...]]:
        replies: dict[int, tuple[object, ...]] = {}
        by_conn = {id(self._conns[h]): h for h in hosts}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(hosts):
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(
                [self._conns[h] for h in hosts if h not in replies], timeout=max(left, 0)
            )
            if not ready:
                missing = sorted(set(hosts) - set(replies))
                raise BenchHostError(
                    f"{what}: load processes {missing} did not answer in {timeout_s} s"
                )
            for conn in ready:
                assert isinstance(conn, Connection)
                host = by_conn[id(conn)]
                try:
                    reply = conn.recv()
                except EOFError:
                    raise BenchHostError(f"{what}: load process {host} exited") from None
                if reply[0] == "error":
                    raise BenchHostError(f"{what}: load process {host} failed:\n{reply[1]}")
                replies[host] = reply
        return [replies[h] for h in hosts]

    def wait_ready(self, timeout_s: float) -> None:
        self._collect(range(len(self.plans)), "start-up", timeout_s)

    def hosts_of(self, contender: str) -> list[int]:
        return [p.index for p in self.plans if p.ranks.get(contender)]

    def run_round(self, contender: str, step: int) -> list[tuple[int, int, int]]:
        """Run one round of ``contender``; every taking part load process's
        ``(start_ns, end_ns, cpu_ns)``: its stamps and the CPU its ranks spent."""
        hosts = self.hosts_of(contender)
        for host in hosts:
            self._conns[host].send(("round", contender, step))
        replies = self._collect(hosts, f"{contender} step {step}", CALL_TIMEOUT_S)
        return [(int(r[1]), int(r[2]), int(r[3])) for r in replies]  # type: ignore[call-overload]

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("close",))
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
