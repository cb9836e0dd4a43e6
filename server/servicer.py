"""The grpc.aio servicer: protos in, round table calls, protos out. No arithmetic.

Every rank of a round awaits the same ``asyncio.Future`` (one wake-up per
round, not per rank) and one ``loop.call_later`` timer per round enforces the
deadline. A finished round's answers (response proto and rich status) are
encoded once and handed to every rank; only the culprit of an invalid
contribution, or a rank that listed its terms in another order, gets its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from lossreduce.errors import LossReduceError
from lossreduce.status_codec import to_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

from .metrics import CoordinatorMetrics
from .outcomes import OutcomeKind, RoundKey
from .round_table import Admission, Contribution, Round, RoundTable
from .validation import completed_terms_mismatch

__all__ = ["CoordinatorServicer", "round_status"]

_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}

# (the response, the status to abort a unary call with, or None when OK)
_Answer = tuple[pb.ReduceResponse, grpc.Status | None]


class _RoundWire:
    """The servicer's state of one round, kept in ``Round.handle``."""

    __slots__ = ("culprit", "error", "future", "ok", "ok_terms", "timer")

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.ok: _Answer | None = None
        self.ok_terms: tuple[str, ...] = ()
        self.error: _Answer | None = None
        self.culprit: _Answer | None = None


def _wire(rnd: Round) -> _RoundWire:
    wire = rnd.handle
    if wire is None:
        wire = rnd.handle = _RoundWire()
    assert isinstance(wire, _RoundWire)
    return wire


def _key_proto(key: RoundKey) -> pb.RoundKey:
    return pb.RoundKey(job=key.job, group=key.group, step=key.step)


def _error_answer(key: RoundKey, err: LossReduceError) -> _Answer:
    status = to_status(err)
    return pb.ReduceResponse(round=_key_proto(key), error=status), rpc_status.to_status(status)


def _normalizers(rnd: Round, terms: tuple[str, ...]) -> list[pb.TermNormalizer]:
    assert rnd.outcome is not None
    by_term = {n.term: n for n in rnd.outcome.normalizers}
    return [
        pb.TermNormalizer(term=t, value=by_term[t].value, zero_ranks=by_term[t].zero_ranks)
        for t in terms
    ]


def _answer(rnd: Round, c: Contribution) -> _Answer:
    """What rank ``c.rank`` receives for the finished round ``rnd``, encoded once per round."""
    outcome = rnd.outcome
    assert outcome is not None
    wire = _wire(rnd)
    err = outcome.error_for(c.rank)
    if err is None:
        if wire.ok is None:
            wire.ok_terms = tuple(n.term for n in outcome.normalizers)
            response = pb.ReduceResponse(
                round=_key_proto(rnd.key), normalizers=_normalizers(rnd, wire.ok_terms)
            )
            wire.ok = (response, None)
        if c.terms == wire.ok_terms:
            return wire.ok
        mismatch = completed_terms_mismatch(rnd.key, c, wire.ok_terms)
        if mismatch is not None:
            # The table answers such a contribution with its own error; never crash the
            # call (or a stream with requests queued behind it) if one slips through.
            return _error_answer(rnd.key, mismatch)
        # This rank listed the same terms in another order: answer in its order.
        return pb.ReduceResponse(
            round=_key_proto(rnd.key), normalizers=_normalizers(rnd, c.terms)
        ), None
    if outcome.culprit is not None and err is outcome.culprit:
        if wire.culprit is None:
            wire.culprit = _error_answer(rnd.key, outcome.culprit)
        return wire.culprit
    if wire.error is None:
        wire.error = _error_answer(rnd.key, err)
    return wire.error


def round_status(rnd: Round, now: float) -> pb.RoundStatus:
    """The ``RoundStatus`` of a live or finished round."""
    outcome = rnd.outcome
    if outcome is None:
        state = pb.ROUND_STATE_COLLECTING
    elif outcome.kind is OutcomeKind.COMPLETED:
        state = pb.ROUND_STATE_COMPLETED
    else:
        state = pb.ROUND_STATE_FAILED
    status = pb.RoundStatus(
        round=_key_proto(rnd.key),
        state=state,
        world_size=rnd.world_size,
        arrived_ranks=rnd.arrived_ranks(),
        missing_ranks=rnd.missing_ranks(),
        partial_sums=[
            pb.TermNormalizer(term=n.term, value=n.value, zero_ranks=n.zero_ranks)
            for n in rnd.partial_sums()
        ],
        age_seconds=max(0.0, now - rnd.created_at),
    )
    if outcome is not None and outcome.error is not None:
        status.error.CopyFrom(to_status(outcome.error))
    return status


class CoordinatorServicer(pb_grpc.ReductionCoordinatorServicer):  # type: ignore[misc]
    """``lossreduce.v2.ReductionCoordinator`` over one :class:`RoundTable`."""

    def __init__(
        self,
        table: RoundTable,
        metrics: CoordinatorMetrics | None = None,
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._clock = clock
        self._drained = asyncio.Event()

    # -- rounds -----------------------------------------------------------------

    def _admit(self, request: pb.ReduceRequest) -> tuple[Contribution, Admission]:
        c = Contribution.from_request(request)
        r = request.round
        admission = self._table.contribute(RoundKey(r.job, r.group, r.step), c, self._clock())
        rnd = admission.round
        if admission.created and rnd is not None and rnd.outcome is None:
            loop = asyncio.get_running_loop()
            _wire(rnd).timer = loop.call_later(self._timeout_s, self._on_deadline, rnd)
        if admission.finished and rnd is not None:
            self._wake(rnd)
        return c, admission

    async def _respond(self, c: Contribution, admission: Admission) -> _Answer:
        if admission.error is not None:
            r = admission.error
            return _error_answer(RoundKey(r.job, r.group, r.step or 0), r)
        rnd = admission.round
        assert rnd is not None
        if rnd.outcome is None:
            wire = _wire(rnd)
            if wire.future is None:
                wire.future = asyncio.get_running_loop().create_future()
            # shield: a cancelled caller must not cancel the round's shared future.
            await asyncio.shield(wire.future)
        return _answer(rnd, c)

    def _on_deadline(self, rnd: Round) -> None:
        if self._table.time_out(rnd, self._clock()):
            self._wake(rnd)

    def _wake(self, rnd: Round) -> None:
        wire = rnd.handle
        if isinstance(wire, _RoundWire):
            if wire.timer is not None:
                wire.timer.cancel()
                wire.timer = None
            if wire.future is not None and not wire.future.done():
                wire.future.set_result(None)
        if self._table.closing and self._table.live_count == 0:
            self._drained.set()

    def _count_error(self, method: str, status: status_pb2.Status) -> None:
        if self._metrics is not None:
            self._metrics.rpc_error(method, _CODES.get(status.code, grpc.StatusCode.UNKNOWN))

    # -- RPCs -------------------------------------------------------------------

    async def Reduce(  # noqa: N802 (gRPC method name)
        self, request: pb.ReduceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReduceResponse:
        response, abort_with = await self._respond(*self._admit(request))
        if abort_with is not None:
            self._count_error("Reduce", response.error)
            await context.abort_with_status(abort_with)
        return response

    async def ReduceStream(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[pb.ReduceRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReduceResponse]:
        # Requests are admitted as they arrive (a worker may pipeline several
        # steps) and answered strictly in request order.
        pending: asyncio.Queue[tuple[Contribution, Admission] | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read_stream(request_iterator, pending))
        try:
            while (item := await pending.get()) is not None:
                response, abort_with = await self._respond(*item)
                if abort_with is not None:
                    self._count_error("ReduceStream", response.error)
                yield response
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read_stream(
        self,
        request_iterator: AsyncIterator[pb.ReduceRequest],
        pending: asyncio.Queue[tuple[Contribution, Admission] | None],
    ) -> None:
        try:
            async for request in request_iterator:
                pending.put_nowait(self._admit(request))
        finally:
            pending.put_nowait(None)

    async def GetRound(  # noqa: N802 (gRPC method name)
        self, request: pb.GetRoundRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RoundStatus:
        r = request.round
        rnd = self._table.lookup(RoundKey(r.job, r.group, r.step))
        if rnd is None:
            return pb.RoundStatus(round=r, state=pb.ROUND_STATE_UNKNOWN)
        return round_status(rnd, self._clock())

    async def ListRounds(  # noqa: N802 (gRPC method name)
        self, request: pb.ListRoundsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListRoundsResponse:
        now = self._clock()
        return pb.ListRoundsResponse(
            rounds=[round_status(rnd, now) for rnd in self._table.rounds(request.job)]
        )

    # -- lifecycle --------------------------------------------------------------

    def sweep(self) -> int:
        """Time out overdue rounds and forget idle groups; returns the rounds ended."""
        ended = self._table.expire(self._clock())
        for rnd in ended:
            self._wake(rnd)
        return len(ended)

    async def drain(self, grace_s: float) -> int:
        """Open no new rounds, give live ones ``grace_s`` to finish, then abort the rest.

        Returns how many rounds were aborted.
        """
        self._table.close()
        if self._table.live_count:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace_s)
        aborted = self._table.abort_all(self._clock())
        for rnd in aborted:
            self._wake(rnd)
        return len(aborted)
