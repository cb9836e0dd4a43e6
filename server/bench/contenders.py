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
import datetime
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from torch._C._distributed_c10d import PrefixStore, TCPStore

from lossreduce.client.aggregator import AggregatorSettings, NodeAggregator
from lossreduce.contribution import Contribution
from lossreduce.server.bench.workload import CONTRACT, TERMS, partials_for
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "CALL_TIMEOUT_S",
    "CoordinatorStreamRanks",
    "CoordinatorUnaryRanks",
    "Endpoints",
    "GlooRank",
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
    ranks_per_node: int = 8
    """Hierarchical contender: ranks per node, i.e. per node-local aggregator."""


class RankSide(Protocol):
    """One contender's view of the ranks hosted by one load process."""

    exact: bool
    """Whether the sums are correctly rounded (bit-identical to ``math.fsum``)."""

    async def run_round(self, step: int) -> list[Sequence[float]]:
        """Contribute every local rank's partials for ``step``; return the sums
        each local rank received, in the order of the ranks."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


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


class _CoordinatorRanks:
    """Shared set-up of the two coordinator contenders: one channel per rank."""

    exact = True
    group = ""

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        self._job = endpoints.job
        self._ranks = tuple(ranks)
        self._world_size = world_size
        self._channels = [grpc.aio.insecure_channel(endpoints.coordinator) for _ in self._ranks]
        self._stubs = [pb_grpc.ReductionCoordinatorStub(channel) for channel in self._channels]

    def _requests(self, step: int) -> list[pb.ReduceRequest]:
        return [
            _request(self._job, self.group, step, rank, self._world_size) for rank in self._ranks
        ]

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self._channels))


class CoordinatorStreamRanks(_CoordinatorRanks):
    """Contender 1: each rank keeps one ``ReduceStream`` open for the whole run."""

    group = "stream"

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        super().__init__(endpoints, ranks, world_size)
        self._calls = [stub.ReduceStream() for stub in self._stubs]

    async def _one(self, call: grpc.aio.StreamStreamCall, request: pb.ReduceRequest) -> list[float]:
        await call.write(request)
        response = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
        return _sums(response, self.group, request.rank, request.round.step)

    async def run_round(self, step: int) -> list[Sequence[float]]:
        requests = self._requests(step)
        return list(
            await asyncio.gather(
                *(self._one(call, req) for call, req in zip(self._calls, requests, strict=True))
            )
        )

    async def close(self) -> None:
        for call in self._calls:
            await call.done_writing()
        await super().close()


class CoordinatorUnaryRanks(_CoordinatorRanks):
    """Contender 2: each rank makes one unary ``Reduce`` call per round."""

    group = "unary"

    async def _one(
        self, stub: pb_grpc.ReductionCoordinatorStub, request: pb.ReduceRequest
    ) -> list[float]:
        response = await stub.Reduce(request, timeout=CALL_TIMEOUT_S)
        return _sums(response, self.group, request.rank, request.round.step)

    async def run_round(self, step: int) -> list[Sequence[float]]:
        requests = self._requests(step)
        return list(
            await asyncio.gather(
                *(self._one(stub, req) for stub, req in zip(self._stubs, requests, strict=True))
            )
        )


class HierarchicalRanks:
    """Contender 6: the coordinator behind node-local aggregators. Consecutive
    blocks of ``ranks_per_node`` ranks form a node; each node's aggregator
    pre-sums its ranks' partials (exactly) and sends one contribution over its
    own stream. The node's ranks are asyncio tasks next to their aggregator, so
    the rank-to-aggregator hop costs less here than over a node's local IPC. Each
    node hands its ranks' contributions to its aggregator in one call: on a real
    cluster that node-local work runs on the node's own CPUs, in parallel, so the
    bench keeps it off the 2 cores it shares with the coordinator."""

    exact = True

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:

        per_node = endpoints.ranks_per_node
        if len(ranks) % per_node or ranks[0] % per_node:
            raise ValueError(f"ranks {ranks[0]}..{ranks[-1]} are not whole nodes of {per_node}")
        self._ranks = tuple(ranks)
        self._world_size = world_size
        node_settings = AggregatorSettings(node_timeout_s=CALL_TIMEOUT_S)
        self._nodes = [
            NodeAggregator(
                endpoints.coordinator,
                job=endpoints.job,
                group="hierarchical",
                local_ranks=self._ranks[i * per_node : (i + 1) * per_node],
                world_size=world_size,
                settings=node_settings,
            )
            for i in range(len(self._ranks) // per_node)
        ]
        self._node_ranks = [
            self._ranks[i * per_node : (i + 1) * per_node] for i in range(len(self._nodes))
        ]
        self._contracts = (CONTRACT,) * len(TERMS)

    async def run_round(self, step: int) -> list[Sequence[float]]:
        per_node = [
            node.reduce_node(
                step,
                [
                    Contribution(
                        rank, self._world_size, TERMS, partials_for(rank, step), self._contracts
                    )
                    for rank in node_ranks
                ],
            )
            for node, node_ranks in zip(self._nodes, self._node_ranks, strict=True)
        ]
        received: list[Sequence[float]] = []
        for results in await asyncio.gather(*per_node):
            for result in results:
                if isinstance(result, Exception):
                    raise RoundFailedError(f"coordinator hierarchical: {result}")
                received.append([result[t] for t in TERMS])
        return received

    async def close(self) -> None:
        for node in self._nodes:
            await node.close()


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
