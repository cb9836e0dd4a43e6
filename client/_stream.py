"""One long-lived ReduceStream shared by every reduce() call of a client.

The coordinator answers a stream's requests in request order, so matching is
FIFO: each send appends a waiter to a queue under the write lock (the queue's
order is the wire order), and one reader task resolves waiters front to back.
Several steps may be in flight at once (pipelining). With ``caller_reads``, a
call that finds no read in progress reads its own answer instead of waking a
reader task for it (one task step less per round, the common case of one
call at a time); answers owed to calls queued behind it are read by a task.
A caller cancelled mid-read (deadline, cancel) then cancels the stream with
the read, as gRPC does, so the others re-send. If the stream breaks —
the coordinator went away, the stream ended, or an answer does not match the
round at the front of the queue — every waiter gets :class:`StreamBrokenError` and
the client carries on with unary Reduce calls; contributions are idempotent,
so re-sending what the broken stream may already have delivered is safe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2, status_pb2

from lossreduce._compat import cancelling
from lossreduce.client._transport import status_of
from lossreduce.v2 import coordinator_pb2 as pb

__all__ = ["ReduceStreamSession", "StreamBrokenError"]


class StreamBrokenError(Exception):
    """The shared stream failed before this request's answer arrived.

    ``status`` is what broke it (UNAVAILABLE for a lost coordinator).
    """

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


@dataclass
class _Waiter:
    key: tuple[str, str, int]
    future: asyncio.Future[pb.ReduceResponse]


class ReduceStreamSession:
    """One open ReduceStream call and its FIFO of waiting requests.

    Owned by one client on one event loop; :meth:`close` cancels the reader
    task and the call. ``caller_reads``: see the module docstring.
    """

    def __init__(self, call: grpc.aio.StreamStreamCall, *, caller_reads: bool = False) -> None:
        self._call = call
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._write_lock = asyncio.Lock()
        # What broke the stream; each waiter gets its own StreamBrokenError.
        self._broken: status_pb2.Status | None = None
        self._caller_reads = caller_reads
        # Whether a read is in progress (a caller's or the reader task's).
        self._reading = not caller_reads
        self._reader: asyncio.Task[None] | None = (
            None if caller_reads else asyncio.get_running_loop().create_task(self._read_loop())
        )

    @property
    def broken(self) -> bool:
        return self._broken is not None

    async def submit(
        self, request: pb.ReduceRequest, sent: asyncio.Future[None] | None = None
    ) -> pb.ReduceResponse:
        """Send ``request`` and wait for its answer (raises StreamBrokenError);
        ``sent``, if given, is marked done once the request is written."""
        if self._broken is not None:
            raise StreamBrokenError(self._broken)
        waiter = _Waiter(
            key=(request.round.job, request.round.group, request.round.step),
            future=asyncio.get_running_loop().create_future(),
        )
        async with self._write_lock:
            if self._broken is not None:
                raise StreamBrokenError(self._broken)
            self._waiters.append(waiter)
            try:
                await self._call.write(request)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self.broken or cancelling(task):
                    # The caller gave up mid-write: the stream's framing is unknown.
                    self._break(_status(code_pb2.CANCELLED, "a stream write was cancelled"))
                    _retrieved(waiter.future)  # this caller leaves; nobody reads its error
                    raise
                # gRPC raises CancelledError from a write on a call that _break()
                # cancelled meanwhile; the waiter already holds StreamBrokenError.
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                self._break(_status_of(exc))
        if sent is not None and not sent.done():
            sent.set_result(None)
        if self._caller_reads and not self._reading:
            return await self._read_until(waiter)
        # If the caller gives up (deadline), the waiter stays queued so the
        # answer that still arrives for it is matched and dropped, not misrouted.
        return await waiter.future

    async def close(self) -> None:
        self._break(_status(code_pb2.CANCELLED, "the client closed the stream"))
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _read_until(self, waiter: _Waiter) -> pb.ReduceResponse:
        """Read answers (in wire order) until ``waiter``'s has arrived."""
        self._reading = True
        try:
            while not waiter.future.done() and await self._read_one():
                pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.broken or cancelling(task):
                # gRPC cancelled the whole call with this caller's read.
                self._break(_status(code_pb2.CANCELLED, "a stream read was cancelled"))
                _retrieved(waiter.future)  # this caller leaves; nobody reads its error
                raise
            # _break() cancelled the call meanwhile; the waiter holds why.
        finally:
            if self._waiters and self._broken is None:
                # Answers owed to calls queued behind this one: a task reads them.
                self._reader = asyncio.get_running_loop().create_task(self._read_loop())
            else:
                self._reading = False
        return await waiter.future

    async def _read_loop(self) -> None:
        """Without ``caller_reads``, for good; with it, while calls wait."""
        self._reading = True
        try:
            while (not self._caller_reads or self._waiters) and await self._read_one():
                pass
        finally:
            self._reading = False

    async def _read_one(self) -> bool:
        """Read and deliver one answer; False once the stream broke."""
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._break(_status_of(exc))
            return False
        if response is grpc.aio.EOF:
            self._break(_status(code_pb2.UNAVAILABLE, "the coordinator ended the stream"))
            return False
        assert isinstance(response, pb.ReduceResponse)
        self._deliver(response)
        return self._broken is None

    def _deliver(self, response: pb.ReduceResponse) -> None:
        key = (response.round.job, response.round.group, response.round.step)
        if not self._waiters or self._waiters[0].key != key:
            expected = self._waiters[0].key if self._waiters else "no request"
            self._break(
                _status(
                    code_pb2.UNAVAILABLE,
                    f"the stream answered round {key} while waiting for {expected}",
                )
            )
            return
        waiter = self._waiters.popleft()
        if not waiter.future.done():
            waiter.future.set_result(response)

    def _break(self, status: status_pb2.Status) -> None:
        if self._broken is None:
            self._broken = status
            self._call.cancel()
        while self._waiters:
            future = self._waiters.popleft().future
            if not future.done():
                future.set_exception(StreamBrokenError(self._broken))


def _retrieved(future: asyncio.Future[pb.ReduceResponse]) -> None:
    """Mark a failed waiter's error as seen, so asyncio does not log it as lost."""
    if future.done() and not future.cancelled():
        future.exception()


def _status(code: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


def _status_of(exc: Exception) -> status_pb2.Status:
    if isinstance(exc, grpc.aio.AioRpcError):
        return status_of(exc)
    # The call already finished (e.g. the coordinator closed it): treat as lost.
    return _status(code_pb2.UNAVAILABLE, f"stream write failed: {exc}")
