"""The grpc.aio servicer: protos in, round table calls, protos out. No arithmetic.

Each waiting rank parks one bare ``asyncio.Future`` on its round (no task,
no shield: a cancelled caller cancels only its own future; a stream's is its
answering side's one idle future, see :class:`_Stream`) and one
``loop.call_later`` timer per round enforces the deadline. A finished round's
answers (response proto and rich status) are encoded once and handed to every
rank; only the culprit of an invalid contribution, or a rank that listed its
terms in another order, gets its own.

The contribution methods answer the wire guard's :class:`Undecodable` markers
themselves, so a stream's requests pass through no extra generator layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
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
from .wire_guard import Undecodable

__all__ = ["CoordinatorServicer", "round_status"]

_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}

# (the response, the status to abort a unary call with, or None when OK)
_Answer = tuple[pb.ReduceResponse, grpc.Status | None]


class _RoundWire:
    """The servicer's state of one round, kept in ``Round.handle``."""

    __slots__ = ("culprit", "error", "ok", "ok_terms", "timer", "waiters")

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[None]] = []
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
        run=rnd.reference.run,
    )
    if outcome is not None and outcome.error is not None:
        status.error.CopyFrom(to_status(outcome.error))
    return status


def _collecting(item: tuple[Contribution, Admission] | grpc.Status) -> Round | None:
    """The round ``item`` still waits for, or None when it can be answered now."""
    if isinstance(item, grpc.Status):
        return None
    rnd = item[1].round
    return rnd if rnd is not None and rnd.outcome is None else None


class _Stream:
    """What a ``ReduceStream``'s reader hands its answering generator: admitted
    requests (or the refusal that ends the input) in request order.

    The answering side sleeps on one future, ``idle``, until the oldest request
    can be answered. When a request arrives while nothing is pending and its
    round is still collecting, the reader parks ``idle`` on that round instead
    of setting it: the round's end wakes the answering side once, rather than
    the arrival and then the round's end each waking it (one task wake-up per
    message instead of two at every world size)."""

    __slots__ = ("ended", "idle", "pending")

    def __init__(self) -> None:
        self.pending: deque[tuple[Contribution, Admission] | grpc.Status] = deque()
        self.idle: asyncio.Future[None] | None = None
        """Pending while the answering side sleeps."""
        self.ended = False

    def push(self, item: tuple[Contribution, Admission] | grpc.Status) -> None:
        self.pending.append(item)
        idle = self.idle
        if idle is None or idle.done():
            return
        rnd = _collecting(item)
        if rnd is not None and len(self.pending) == 1:
            _wire(rnd).waiters.append(idle)
        else:
            idle.set_result(None)

    def end(self) -> None:
        self.ended = True
        idle = self.idle
        if idle is not None and not idle.done():
            idle.set_result(None)


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
        rnd = admission.round
        if rnd is not None and rnd.outcome is None:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            _wire(rnd).waiters.append(waiter)
            await waiter
        return self._answer_now(c, admission)

    @staticmethod
    def _answer_now(c: Contribution, admission: Admission) -> _Answer:
        """The answer to an admitted contribution whose round has ended (or that was refused)."""
        if admission.error is not None:
            r = admission.error
            return _error_answer(RoundKey(r.job, r.group, r.step or 0), r)
        rnd = admission.round
        assert rnd is not None  # (and ended: _answer checks)
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
            waiters, wire.waiters = wire.waiters, []
            for waiter in waiters:
                if not waiter.done():  # a cancelled caller's
                    waiter.set_result(None)
        if self._table.closing and self._table.live_count == 0:
            self._drained.set()

    def _count_error(self, method: str, status: status_pb2.Status) -> None:
        if self._metrics is not None:
            self._metrics.rpc_error(method, _CODES.get(status.code, grpc.StatusCode.UNKNOWN))

    # -- RPCs -------------------------------------------------------------------

    async def Reduce(  # noqa: N802 (gRPC method name)
        self, request: pb.ReduceRequest | Undecodable, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReduceResponse:
        if isinstance(request, Undecodable):
            await context.abort_with_status(request.status("Reduce"))
            return pb.ReduceResponse()  # not reached: abort_with_status raises
        response, abort_with = await self._respond(*self._admit(request))
        if abort_with is not None:
            self._count_error("Reduce", response.error)
            await context.abort_with_status(abort_with)
        return response

    async def ReduceStream(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[pb.ReduceRequest | Undecodable],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReduceResponse]:
        # Requests are admitted as they arrive (a worker may pipeline several
        # steps, each waiting on other ranks) and answered strictly in request
        # order: the reader admits, this generator answers the oldest.
        stream = _Stream()
        pending = stream.pending
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read_stream(request_iterator, stream))
        try:
            while True:
                waiting_for = _collecting(pending[0]) if pending else None
                if waiting_for is not None or not (pending or stream.ended):
                    idle = stream.idle = loop.create_future()
                    if waiting_for is not None:
                        _wire(waiting_for).waiters.append(idle)
                    await idle
                    continue
                if not pending:
                    break
                item = pending.popleft()
                if isinstance(item, grpc.Status):
                    # Undecodable bytes name no round: the stream ends with their status,
                    # after the answers owed to the requests before them.
                    await context.abort_with_status(item)
                    break  # not reached: abort_with_status raises
                response, abort_with = self._answer_now(*item)
                if abort_with is not None:
                    self._count_error("ReduceStream", response.error)
                yield response
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read_stream(
        self, request_iterator: AsyncIterator[pb.ReduceRequest | Undecodable], stream: _Stream
    ) -> None:
        try:
            async for request in request_iterator:
                if isinstance(request, Undecodable):
                    stream.push(request.status("ReduceStream"))
                    return
                stream.push(self._admit(request))
        finally:
            stream.end()

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

    async def Claim(  # noqa: N802 (gRPC method name)
        self, request: pb.ClaimRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClaimResponse:
        r = request.round
        key = RoundKey(r.job, r.group, r.step)
        holder = self._table.holder(r.job, r.group)
        previous = None if holder is None else holder.run
        refused = self._table.claim(key, request.run, request.rank, self._clock())
        if refused is not None:
            status = to_status(refused)
            self._count_error("Claim", status)
            await context.abort_with_status(rpc_status.to_status(status))
        return pb.ClaimResponse(
            round=r, run=request.run, took_over=previous not in (None, request.run)
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
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace_s)
        aborted = self._table.abort_all(self._clock())
        for rnd in aborted:
            self._wake(rnd)
        return len(aborted)
