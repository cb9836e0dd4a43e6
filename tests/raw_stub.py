"""Raw-stub helpers for the coordinator's integration tests (no client package).

Used by the coordinator's and the status command's integration tests (the
``ranks`` fixture of ``tests/conftest.py`` wraps :class:`Ranks`): it sends contributions with
the generated stubs, over unary ``Reduce`` or one ``ReduceStream`` per call,
from as many threads as there are contributions, and decodes every answer to
either the ``ReduceResponse`` or the :mod:`lossreduce.errors` exception.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2
from grpc_status import rpc_status

from lossreduce.contribution import Contribution
from lossreduce.errors import LossReduceError
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

CALL_TIMEOUT_S = 30.0
"""Deadline of every test RPC: far above any round timeout the tests use."""


@dataclass(frozen=True)
class Send:
    """One rank's contribution to one round."""

    rank: int
    world_size: int
    partials: Mapping[str, float]
    step: int = 1
    job: str = "job-t"
    group: str = "actor"
    contracts: Mapping[str, str] | None = None
    run: str = ""

    def request(self) -> pb.ReduceRequest:
        contracts = self.contracts or {}
        terms = tuple(self.partials)
        contribution = Contribution(
            rank=self.rank,
            world_size=self.world_size,
            terms=terms,
            values=tuple(self.partials.values()),
            contracts=tuple(contracts.get(t, "mean:token_mean") for t in terms),
            run=self.run,
        )
        return contribution.request(pb.RoundKey(job=self.job, group=self.group, step=self.step))


Answer = pb.ReduceResponse | LossReduceError


@dataclass(frozen=True)
class Received:
    """A decoded answer and the gRPC status code it came with."""

    answer: Answer
    code: int

    @property
    def normalizers(self) -> dict[str, tuple[float, int]]:
        assert isinstance(self.answer, pb.ReduceResponse), self.answer
        return {n.term: (n.value, n.zero_ranks) for n in self.answer.normalizers}

    @property
    def error(self) -> LossReduceError:
        assert isinstance(self.answer, LossReduceError), self.answer
        return self.answer


class Ranks:
    """Sends contributions to one coordinator over a shared channel."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ReductionCoordinatorStub(self.channel)

    def unary(self, send: Send) -> Received:
        try:
            response = self.stub.Reduce(send.request(), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            status = rpc_status.from_call(err)
            code = err.code().value[0]
        else:
            return Received(response, code_pb2.OK)
        assert status is not None, f"status {code} came without rich details"
        assert status.code == code
        return Received(from_status(status), status.code)

    def stream(self, sends: Sequence[Send]) -> list[Received]:
        """All of ``sends`` over one stream, written before any answer is read."""
        responses = self.stub.ReduceStream(
            iter([s.request() for s in sends]), timeout=CALL_TIMEOUT_S
        )
        return [self.decode(r) for r in responses]

    @staticmethod
    def decode(response: pb.ReduceResponse) -> Received:
        if response.HasField("error") and response.error.code != code_pb2.OK:
            return Received(from_status(response.error), response.error.code)
        return Received(response, code_pb2.OK)

    def round(self, sends: Sequence[Send], mode: str) -> list[Received]:
        """Every contribution from its own thread at once; answers in the order of ``sends``."""
        barrier = threading.Barrier(len(sends))

        def one(send: Send) -> Received:
            barrier.wait()
            return self.unary(send) if mode == "unary" else self.stream([send])[0]

        with ThreadPoolExecutor(len(sends)) as pool:
            return list(pool.map(one, sends))

    def close(self) -> None:
        self.channel.close()
