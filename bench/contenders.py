"""The rank side of each contender of ``lossreduce bench``.

One load process hosts a slice of the ranks of a world; for each contender it
holds one :class:`RankSide`, which contributes the partials of those ranks to
one round and returns the sums each rank received (per rank, in term order).
The load process times the call and checks the sums afterwards, so checking
costs nothing inside the measured window.

Each rank keeps its own connection (gRPC channel, TCPStore client, gloo
process group), as it would in its own process; ranks sharing a load process
are simulated as concurrent asyncio tasks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import struct
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from torch._C._distributed_c10d import PrefixStore, TCPStore

from lossreduce.bench.workload import CONTRACT, TERMS, partials_for
from lossreduce.client import AsyncReductionClient, ClientSettings, ReductionClient
from lossreduce.client.agent import AgentSettings, NodeAgent
from lossreduce.contribution import Contribution
from lossreduce.errors import LossReduceError
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "CALL_TIMEOUT_S",
    "BareEchoRanks",
    "BareStreamRanks",
    "CoordinatorStreamRanks",
    "CoordinatorUnaryRanks",
    "Endpoints",
    "GlooRank",
    "HierarchicalEchoRanks",
    "HierarchicalRanks",
    "RankSide",
    "RoundFailedError",
    "TCPStoreRanks",
]

CALL_TIMEOUT_S = 120.0
"""Bound on any single wait of a rank; a hung contender fails the run, never stalls it."""

_PACK = struct.Struct(f"<{len(TERMS)}d")


class RoundFailedError(RuntimeError):
    """A contender answered a round with an error instead of sums."""


@dataclass(frozen=True)
class Endpoints:
    """Where each contender's server listens; sent to every load process."""

    coordinator: str
    """gRPC target of the coordinator, host:port."""
    store_host: str
    store_port: int
    """The TCPStore server (hosted by the bench driver): the TCPStore contender
    and gloo's rendezvous (under their own key prefixes)."""
    ray_address: str
    """Address of the Ray cluster hosting the Ray-actor coordinator; empty: no Ray."""
    ray_actor: str
    """Name of the Ray-actor coordinator for this world size."""
    job: str
    """Job name of this world size's rounds on the coordinator."""
    echo: str = ""
    """gRPC target of the echo server (the bare-echo references); empty: none."""
    ranks_per_node: int = 8
    """Hierarchical contender: ranks per node, i.e. per node-local aggregator."""


class RankSide(Protocol):
    """One contender's view of the ranks hosted by one load process."""

    exact: bool
    """Whether the sums are correctly rounded (bit-identical to ``math.fsum``)."""
    checked: bool
    """Whether the sums are checked at all (not for the echo references)."""

    def run_round(self, step: int) -> Awaitable[list[Sequence[float]]] | list[Sequence[float]]:
        """Contribute every local rank's partials for ``step``; return the sums
        each local rank received, in the order of the ranks. Blocking sides
        return them, the others an awaitable run on the load process's loop."""
        ...

    def close(self) -> Awaitable[None] | None:
        """Release connections (blocking, or an awaitable)."""
        ...


_OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def _request(job: str, group: str, step: int, rank: int, world_size: int) -> pb.ReduceRequest:
    contribution = Contribution(
        rank, world_size, TERMS, partials_for(rank, step), (CONTRACT,) * len(TERMS)
    )
    return contribution.request(pb.RoundKey(job=job, group=group, step=step))


def _sums(response: pb.ReduceResponse, group: str, rank: int, step: int) -> list[float]:
    if response.HasField("error") and response.error.code != 0:
        raise RoundFailedError(
            f"coordinator {group}: rank {rank} step {step} failed: "
            f"code {response.error.code}: {response.error.message}"
        )
    return [normalizer.value for normalizer in response.normalizers]


def _partials(rank: int, step: int) -> dict[str, float]:
    return dict(zip(TERMS, partials_for(rank, step), strict=True))


async def _reduce_all(
    group: str, clients: Sequence[AsyncReductionClient], step: int, contracts: dict[str, str]
) -> list[Sequence[float]]:
    """Every client's ``reduce`` of ``step`` at once; the sums each received, in order."""
    calls = [client.reduce(step, _partials(client.rank, step), contracts) for client in clients]
    received: list[Sequence[float]] = []
    for result in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(result, BaseException):
            raise RoundFailedError(f"coordinator {group}: {result}") from result
        received.append([result[t] for t in TERMS])
    return received


class _ShippedClientRanks:
    """The coordinator as a trainer worker reaches it: each rank runs the shipped
    client. A rank alone in its process uses the blocking
    :class:`~lossreduce.client.ReductionClient`, called from the load process's
    own thread as a training loop calls it; ranks simulated as tasks each use an
    :class:`~lossreduce.client.AsyncReductionClient` on the process's loop."""

    exact = True
    checked = True
    group = ""
    use_stream = True

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        self._ranks = tuple(ranks)
        self._contracts = dict.fromkeys(TERMS, CONTRACT)
        settings = ClientSettings(
            call_timeout_s=CALL_TIMEOUT_S, token=None, use_stream=self.use_stream
        )
        self._blocking: ReductionClient | None = None
        self._clients: list[AsyncReductionClient] = []
        if len(self._ranks) == 1:
            self._blocking = ReductionClient(
                endpoints.coordinator,
                job=endpoints.job,
                group=self.group,
                rank=self._ranks[0],
                world_size=world_size,
                settings=settings,
            )
        else:
            self._clients = [
                AsyncReductionClient(
                    endpoints.coordinator,
                    job=endpoints.job,
                    group=self.group,
                    rank=rank,
                    world_size=world_size,
                    settings=settings,
                )
                for rank in self._ranks
            ]

    def run_round(self, step: int) -> Awaitable[list[Sequence[float]]] | list[Sequence[float]]:
        if self._blocking is None:
            return self._run_tasks(step)
        rank = self._ranks[0]
        try:
            sums = self._blocking.reduce(step, _partials(rank, step), self._contracts)
        except LossReduceError as err:
            raise RoundFailedError(f"coordinator {self.group}: rank {rank}: {err}") from err
        return [[sums[t] for t in TERMS]]

    async def _run_tasks(self, step: int) -> list[Sequence[float]]:
        return await _reduce_all(self.group, self._clients, step, self._contracts)

    def close(self) -> Awaitable[None] | None:
        if self._blocking is not None:
            self._blocking.close()
            return None
        return self._close_tasks()

    async def _close_tasks(self) -> None:
        for client in self._clients:
            await client.close()


class CoordinatorStreamRanks(_ShippedClientRanks):
    """Contender 1: the shipped client over its ``ReduceStream`` (the default)."""

    group = "stream"


class CoordinatorUnaryRanks(_ShippedClientRanks):
    """Contender 2: the shipped client with ``use_stream=False``: one unary
    ``Reduce`` call per round."""

    group = "unary"
    use_stream = False


class BareStreamRanks:
    """The floor: each rank keeps one ``ReduceStream`` of a raw grpc.aio stub
    open for the whole run and writes and reads protos itself, with none of the
    shipped client's deadlines, retries or checks (every rank is a task, even
    alone in its process)."""

    exact = True
    checked = True
    group = "bare-stream"

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        self._job = endpoints.job
        self._target = self._server(endpoints)
        self._ranks = tuple(ranks)
        self._world_size = world_size
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[grpc.aio.StreamStreamCall] = []

    @staticmethod
    def _server(endpoints: Endpoints) -> str:
        return endpoints.coordinator

    def _open(self) -> None:
        """Channels and streams, on the first round: the load process's event loop
        runs only from then on."""
        # A connection per rank, like the shipped client's: grpc.aio otherwise puts every
        # channel of a process to one target on one shared connection, which batches the
        # messages of simulated ranks into fewer reads and flatters the floor.
        self._channels = [
            grpc.aio.insecure_channel(self._target, options=_OWN_CONNECTION) for _ in self._ranks
        ]
        self._calls = [
            pb_grpc.ReductionCoordinatorStub(channel).ReduceStream() for channel in self._channels
        ]

    async def _one(self, call: grpc.aio.StreamStreamCall, request: pb.ReduceRequest) -> list[float]:
        await call.write(request)
        response = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
        return _sums(response, self.group, request.rank, request.round.step)

    async def run_round(self, step: int) -> list[Sequence[float]]:
        if not self._calls:
            self._open()
        requests = [
            _request(self._job, self.group, step, rank, self._world_size) for rank in self._ranks
        ]
        return list(
            await asyncio.gather(
                *(self._one(call, req) for call, req in zip(self._calls, requests, strict=True))
            )
        )

    async def close(self) -> None:
        for call in self._calls:
            await call.done_writing()
        await asyncio.gather(*(channel.close() for channel in self._channels))


class BareEchoRanks(BareStreamRanks):
    """The reference: :class:`BareStreamRanks` against the echo server
    (:mod:`lossreduce.bench.echo`), which answers each message at once
    with the rank's own partials, so the sums are not checked."""

    checked = False
    group = "bare-echo"

    @staticmethod
    def _server(endpoints: Endpoints) -> str:
        return endpoints.echo


class HierarchicalRanks:
    """Contender 6: the coordinator behind node agents, the shipped component
    (:class:`~lossreduce.client.agent.NodeAgent`). Consecutive blocks of
    ``ranks_per_node`` ranks form a node; each node's agent pre-sums its ranks'
    partials (exactly) and sends one contribution per round over its own stream.
    Each rank is an unchanged :class:`~lossreduce.client.AsyncReductionClient`
    pointed at its node's agent over loopback, as on a real node; here the
    agents and their ranks share the load process's event loop, where a real
    node runs them on its own CPUs, in parallel."""

    exact = True
    checked = True
    group = "hierarchical"

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        per_node = endpoints.ranks_per_node
        if len(ranks) % per_node or ranks[0] % per_node:
            raise ValueError(f"ranks {ranks[0]}..{ranks[-1]} are not whole nodes of {per_node}")
        self._ranks = tuple(ranks)
        self._world_size = world_size
        nodes = [self._ranks[i : i + per_node] for i in range(0, len(self._ranks), per_node)]
        self._agents = [
            NodeAgent(
                endpoints.coordinator,
                job=endpoints.job,
                group=self.group,
                world_size=world_size,
                settings=AgentSettings(
                    local_ranks=node,
                    node_timeout_s=CALL_TIMEOUT_S,
                    call_timeout_s=CALL_TIMEOUT_S,
                    token=None,
                ),
            )
            for node in nodes
        ]
        self._nodes = nodes
        self._clients: list[AsyncReductionClient] = []
        self._contracts = dict.fromkeys(TERMS, CONTRACT)

    async def _start(self) -> None:
        """Start the agents and connect their ranks (on the first round: the load
        process's event loop runs only from then on)."""
        for agent in self._agents:
            await agent.start()
        settings = ClientSettings(call_timeout_s=CALL_TIMEOUT_S, token=None)
        self._clients = [
            AsyncReductionClient(
                agent.target,
                job=agent.job or "",
                group=self.group,
                rank=rank,
                world_size=self._world_size,
                settings=settings,
            )
            for agent, node in zip(self._agents, self._nodes, strict=True)
            for rank in node
        ]
        for client in self._clients:
            await client.open()

    async def run_round(self, step: int) -> list[Sequence[float]]:
        if not self._clients:
            await self._start()
        return await _reduce_all(self.group, self._clients, step, self._contracts)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        for agent in self._agents:
            await agent.stop(0.0)


class HierarchicalEchoRanks(HierarchicalRanks):
    """The reference of the hierarchical contender: the same node agents and
    ranks with the echo server upstream in place of the coordinator, so each
    node's contribution is answered at once (with the node's own sums, not
    checked)."""

    checked = False
    group = "hierarchical-echo"

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        super().__init__(
            dataclasses.replace(endpoints, coordinator=endpoints.echo), ranks, world_size
        )


def _store_client(endpoints: Endpoints, prefix: str) -> PrefixStore:
    store = TCPStore(
        endpoints.store_host,
        endpoints.store_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=CALL_TIMEOUT_S),
        wait_for_workers=False,
    )
    return PrefixStore(prefix, store)


class TCPStoreRanks:
    """Contender 4: a reduction over torch's TCPStore. Each rank sets its packed
    partials under ``step/rank``, waits for every rank's key, reads them all
    and sums them locally (``math.fsum``, so the sums are exact too).

    Ranks sharing a load process first all set, then each waits and reads;
    the store calls block, so they run one after another, over one shared
    client: opening hundreds of TCPStore clients stalls about 5 s every ~25
    connections here, and serialized calls gain nothing from more sockets.
    """

    exact = True
    checked = True

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        self._ranks = tuple(ranks)
        self._world_size = world_size
        shared = _store_client(endpoints, f"{endpoints.job}/store/")
        self._stores = [shared for _ in self._ranks]

    async def run_round(self, step: int) -> list[Sequence[float]]:
        import math

        keys = [f"{step}/{rank}" for rank in range(self._world_size)]
        for store, rank in zip(self._stores, self._ranks, strict=True):
            store.set(keys[rank], _PACK.pack(*partials_for(rank, step)))  # type: ignore[arg-type]  # the binding takes bytes too
        received: list[Sequence[float]] = []
        for store in self._stores:
            store.wait(keys)
            rows = [_PACK.unpack(blob) for blob in store.multi_get(keys)]
            received.append([math.fsum(column) for column in zip(*rows, strict=True)])
        return received

    async def close(self) -> None:
        self._stores.clear()


class GlooRank:
    """Contender 3: torch.distributed gloo ``all_reduce`` of a 4-element float64
    tensor; needs one process per rank. Plain float addition, so the sums are
    checked to a relative 1e-9 rather than bit for bit."""

    exact = False
    checked = True

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        import torch.distributed as dist

        if len(ranks) != 1:
            raise ValueError(f"gloo needs one process per rank; got ranks {list(ranks)}")
        self._rank = ranks[0]
        store = _store_client(endpoints, f"{endpoints.job}/gloo/")
        self._group = dist.ProcessGroupGloo(
            store,
            self._rank,
            world_size,
            datetime.timedelta(seconds=CALL_TIMEOUT_S),
        )

    async def run_round(self, step: int) -> list[Sequence[float]]:
        import torch

        tensor = torch.tensor(partials_for(self._rank, step), dtype=torch.float64)  # [len(TERMS)]
        self._group.allreduce([tensor]).wait()  # type: ignore[attr-defined]
        return [tensor.tolist()]

    async def close(self) -> None:
        del self._group
