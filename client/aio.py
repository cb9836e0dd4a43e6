"""The asyncio client: the one implementation of a rank's side of a round.

:class:`lossreduce.client.ReductionClient` runs this same class on an event
loop driven by its caller's thread, so the retry, stream and error logic below
exists once.

A call goes out over the client's shared ReduceStream (or a unary Reduce when
``use_stream`` is off or the stream broke), waits at most ``call_timeout_s``
for the round, and on UNAVAILABLE retries with exponential backoff until the
retry budget runs out. Every failure surfaces as one of the exceptions of
:mod:`lossreduce.errors`, carrying this client's job, group, step and rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TypeVar

import grpc
from google.rpc import code_pb2, status_pb2

from lossreduce._compat import cancelling, within
from lossreduce.client._stream import ReduceStreamSession, StreamBrokenError
from lossreduce.client._transport import call_metadata, open_channel, status_of
from lossreduce.client._wire import (
    RoundContext,
    build_request,
    closed_error,
    deadline_error,
    decode_status,
    normalizers_of,
    parse_response,
    unavailable_error,
)
from lossreduce.client.retry import Backoff, RetryBudget
from lossreduce.client.settings import ClientSettings
from lossreduce.client.types import PartialValue, RoundResult
from lossreduce.errors import ClientClosedError, LossReduceError, UsageError
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["AsyncReductionClient", "ClientState"]

_T = TypeVar("_T")

_MAX_STEP = 2**64 - 1  # RoundKey.step is a uint64
_MAX_RANK = 2**32 - 1  # rank and world_size are uint32


class ClientState(enum.Enum):
    """Lifecycle of a client: UNOPENED -> OPEN -> CLOSED (terminal)."""

    UNOPENED = "unopened"
    """Constructed; the channel opens on first use or on entering the context."""
    OPEN = "open"
    """The channel is open; reduce() may be called."""
    CLOSED = "closed"
    """close() was called; every later reduce() raises ClientClosedError."""


class AsyncReductionClient:
    """One rank's connection to the reduction coordinator (asyncio).

    ::

        async with AsyncReductionClient(
            "127.0.0.1:50051", job="run-7", group="actor", rank=0, world_size=8
        ) as client:
            normalizers = await client.reduce(step, {"pg": tokens, "kl": tokens})

    The client belongs to the event loop it is first used on. Concurrent
    reduce() calls for different steps are fine: they are pipelined over the
    one stream and answered in the order they were sent.
    """

    def __init__(
        self,
        target: str,
        *,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        settings: ClientSettings | None = None,
        run: str = "",
    ) -> None:
        if not 1 <= world_size <= _MAX_RANK:
            raise UsageError(
                f"job {job!r} group {group!r} rank {rank}: world_size={world_size} "
                "must be in [1, 2**32)",
                job=job,
                group=group,
                rank=rank,
            )
        if not 0 <= rank <= _MAX_RANK:
            raise UsageError(
                f"job {job!r} group {group!r}: rank={rank} must be in [0, 2**32)",
                job=job,
                group=group,
            )
        # rank >= world_size is not rejected here: the coordinator rejects it
        # and tells every peer which rank is misconfigured (see _wire).
        self.target = target
        self._job = job
        self._group = group
        self._rank = rank
        self._world_size = world_size
        self._run = run
        self.settings = settings if settings is not None else ClientSettings()
        self._state = ClientState.UNOPENED
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ReductionCoordinatorStub | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._stream: ReduceStreamSession | None = None
        self._backoff = Backoff.from_settings(self.settings)
        self._rng = random.Random()
        self._closed = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.target!r}, job={self.job!r}, group={self.group!r}, "
            f"rank={self.rank}, world_size={self.world_size}, run={self.run!r}, "
            f"state={self._state.value})"
        )

    @property
    def job(self) -> str:
        return self._job

    @property
    def group(self) -> str:
        return self._group

    @property
    def run(self) -> str:
        """The run every request names: the same on all ranks of one launch, new for
        every launch; empty names none (the coordinator then claims nothing for it)."""
        return self._run

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def state(self) -> ClientState:
        return self._state

    async def open(self) -> None:
        """Open the channel (done implicitly by the first reduce())."""
        self.check_open(None)
        loop = asyncio.get_running_loop()
        if self._state is ClientState.UNOPENED:
            self._loop = loop
            self._channel = open_channel(self.target, self.settings)
            self._stub = pb_grpc.ReductionCoordinatorStub(self._channel)
            self._metadata = call_metadata(self.settings)
            self._state = ClientState.OPEN
        elif loop is not self._loop:
            # A grpc.aio channel only works on the loop it was created on.
            raise UsageError(
                f"The client for job {self.job!r} rank {self.rank} was opened on another event "
                "loop; create one client per event loop (or use ReductionClient).",
                job=self.job,
                group=self.group,
                rank=self.rank,
            )

    async def close(self) -> None:
        """Close the stream and the channel; calls still waiting raise ClientClosedError."""
        if self._is_closed():
            return
        self._state = ClientState.CLOSED
        self._closed.set()
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncReductionClient:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def reduce(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """This rank's partials for ``step`` in, the global normalizers out.

        ``partials`` maps term names to this rank's partial normalizer (a Python
        number or a 0-d tensor); ``contracts`` optionally maps terms to their
        contract string (every rank must send the same). Returns term -> global
        normalizer, identical on every rank, in the order of ``partials``.
        Raises a :class:`lossreduce.errors.LossReduceError` subclass otherwise;
        a partial that is not a number, or a contract for a term with no
        partial, is still sent (as NaN) so the peers abort at once, and this
        rank raises :class:`lossreduce.errors.InvalidPartialError` naming it.
        """
        return await self._round(step, partials, contracts, None, normalizers_of)

    async def reduce_detailed(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> RoundResult:
        """Like :meth:`reduce`, also returning how many ranks sent 0 per term."""
        return await self._round(step, partials, contracts, None, parse_response)

    def reduce_start(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> asyncio.Task[dict[str, float]]:
        """:meth:`reduce` as a task of the running loop, started at once.

        The request goes out as soon as the caller next yields to the loop;
        awaiting the task gives what :meth:`reduce` returns or raises.
        Cancelling it stops waiting; the contribution, once sent, still counts
        for the peers, and a stream cancelled with the wait is replaced by the
        next call (calls queued on it re-send, which is idempotent).
        """
        return asyncio.get_running_loop().create_task(self.reduce(step, partials, contracts))

    async def reduce_sending(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None,
        sent: asyncio.Future[None],
    ) -> dict[str, float]:
        """:meth:`reduce`, marking ``sent`` done once the request is written, its
        first attempt failed, or the call ended (what
        :meth:`lossreduce.client.ReductionClient.reduce_start` waits for)."""
        try:
            return await self._round(step, partials, contracts, sent, normalizers_of)
        finally:
            _mark(sent)

    async def claim(self, step: int = 0) -> bool:
        """Claim this client's job and group for its run before the run's first round.

        ``step`` is the first step the run will send: 0 for a new run, the step it
        continues at for a resumed one. The coordinator judges the claim as it would
        that round (see ``ReduceRequest.run``), so a launch that another run's claim
        would refuse learns it now, at start-up, as the same
        :class:`lossreduce.errors.RunConflictError` naming the holder. Retried while
        the coordinator is unavailable, as rounds are. Returns True when this run
        took the claim over from another run (a resumed run continuing past it).
        """
        self.check_open(step)
        ctx = self._context(step)
        if not self.run:
            raise UsageError(
                f"job {self.job!r} group {self.group!r} rank {self.rank}: claim() needs a "
                "run id; this client names none (pass run=...)",
                job=self.job,
                group=self.group,
                rank=self.rank,
            )
        if self._state is not ClientState.OPEN or asyncio.get_running_loop() is not self._loop:
            await self.open()
        request = pb.ClaimRequest(
            round=pb.RoundKey(job=self.job, group=self.group, step=step),
            rank=self.rank,
            run=self.run,
        )
        attempts = 0
        budget: RetryBudget | None = None
        while True:
            if self._is_closed():
                raise self._closed_while_waiting(step)
            attempts += 1
            assert self._stub is not None, "open() ran above"
            try:
                response: pb.ClaimResponse = await self._stub.Claim(
                    request, timeout=self.settings.call_timeout_s, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                status = status_of(exc)
                self._raise_unless_retryable(status, ctx)
            else:
                return response.took_over
            budget = await self._back_off(ctx, status, attempts, budget)

    async def _round(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None,
        sent: asyncio.Future[None] | None,
        parse: Callable[[pb.ReduceResponse, RoundContext], _T],
    ) -> _T:
        """The round's answer for this rank's contribution, through ``parse``."""
        self.check_open(step)
        ctx = self._context(step)
        outgoing = build_request(ctx, partials, contracts)
        if self._state is not ClientState.OPEN or asyncio.get_running_loop() is not self._loop:
            await self.open()
        try:
            result = parse(await self._reduce(ctx, outgoing.request, sent), ctx)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # close() cancels the channel's calls; only a cancellation of the
            # caller's own task should propagate as one.
            if self._is_closed() and not cancelling(task):
                raise self._closed_while_waiting(step) from None
            raise
        except LossReduceError as answer:
            if outgoing.local_error is None:
                raise
            # The coordinator's answer is about the NaN we substituted; what
            # this rank must fix is what could not be encoded.
            raise outgoing.local_error from answer
        if outgoing.local_error is not None:
            raise outgoing.local_error
        return result

    def check_open(self, step: int | None) -> None:
        """Raise ClientClosedError (naming ``step`` if given) if the client was closed."""
        if self._is_closed():
            raise closed_error(self.job, self.group, self.rank, step, while_waiting=False)

    def _is_closed(self) -> bool:
        # A method, not an inline check: close() may run at any await, which
        # mypy's narrowing of self._state cannot see.
        return self._state is ClientState.CLOSED

    def _context(self, step: int) -> RoundContext:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
            raise UsageError(
                f"job {self.job!r} group {self.group!r} rank {self.rank}: step={step!r} "
                "must be an int in [0, 2**64)",
                job=self.job,
                group=self.group,
                rank=self.rank,
            )
        return RoundContext(self.job, self.group, step, self.rank, self.world_size, self.run)

    def _closed_while_waiting(self, step: int) -> ClientClosedError:
        return closed_error(self.job, self.group, self.rank, step, while_waiting=True)

    async def _reduce(
        self, ctx: RoundContext, request: pb.ReduceRequest, sent: asyncio.Future[None] | None
    ) -> pb.ReduceResponse:
        """The coordinator's OK answer to ``request``, retrying while it is unavailable."""
        via_stream = self.settings.use_stream
        attempts = 0
        budget: RetryBudget | None = None
        while True:
            if self._is_closed():
                raise self._closed_while_waiting(ctx.step)
            attempts += 1
            try:
                response = await self._attempt(request, via_stream, sent)
            except StreamBrokenError:
                if self._is_closed():
                    raise self._closed_while_waiting(ctx.step) from None
                # The shared stream is gone; finish this call with unary Reduce,
                # at once: that call's own status (UNAVAILABLE, UNAUTHENTICATED...)
                # decides whether to back off or to raise.
                via_stream = False
                continue
            except asyncio.TimeoutError:
                raise deadline_error(ctx, self.target, self.settings.call_timeout_s) from None
            except grpc.aio.AioRpcError as exc:
                status = status_of(exc)
                self._raise_unless_retryable(status, ctx)
            else:
                if response.error.code == code_pb2.OK:
                    return response
                status = response.error
                self._raise_unless_retryable(status, ctx)
            if sent is not None:
                # A reduce_start() returns now; the retries go on in the task.
                _mark(sent)
            budget = await self._back_off(ctx, status, attempts, budget)

    async def _back_off(
        self,
        ctx: RoundContext,
        status: status_pb2.Status,
        attempts: int,
        budget: RetryBudget | None,
    ) -> RetryBudget:
        """Sleep before attempt ``attempts + 1`` (waking at once if the client is
        closed), or raise :class:`CoordinatorUnavailableError` when the retry
        budget is spent. Built on the first failure only: most calls never need one."""
        loop = asyncio.get_running_loop()
        if budget is None:
            budget = RetryBudget(self._backoff, self.settings.retry_budget_s, self._rng)
        budget.attempts = attempts
        delay = budget.failed(loop.time())
        if delay is None:
            raise unavailable_error(
                ctx, self.target, budget.attempts, budget.elapsed(loop.time()), status
            )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closed.wait(), delay)
        return budget

    def _raise_unless_retryable(self, status: status_pb2.Status, ctx: RoundContext) -> None:
        if status.code == code_pb2.UNAVAILABLE:
            return
        if status.code == code_pb2.DEADLINE_EXCEEDED:
            raise deadline_error(ctx, self.target, self.settings.call_timeout_s)
        if status.code == code_pb2.CANCELLED and self._is_closed():
            raise self._closed_while_waiting(ctx.step)
        raise decode_status(status, ctx)

    async def _attempt(
        self, request: pb.ReduceRequest, via_stream: bool, sent: asyncio.Future[None] | None
    ) -> pb.ReduceResponse:
        assert self._stub is not None, "open() runs before any attempt"
        timeout = self.settings.call_timeout_s
        if via_stream:
            session = self._stream
            if session is None or session.broken:
                session = await self._stream_session()
            return await within(timeout, session.submit(request, sent))
        call = self._stub.Reduce(request, timeout=timeout, metadata=self._metadata)
        if sent is not None:
            # The call's own task, scheduled before this mark, sends the request.
            _mark(sent)
        response: pb.ReduceResponse = await call
        return response

    async def _stream_session(self) -> ReduceStreamSession:
        """The shared stream, reopened if the previous one broke."""
        assert self._stub is not None, "open() runs before any attempt"
        current = self._stream
        if current is not None and not current.broken:
            return current
        # This client's calls read their own answers: one task step less per round.
        session = self._stream = ReduceStreamSession(
            self._stub.ReduceStream(metadata=self._metadata), caller_reads=True
        )
        if current is not None:
            await current.close()
        return session


def _mark(sent: asyncio.Future[None]) -> None:
    if not sent.done():
        sent.set_result(None)
