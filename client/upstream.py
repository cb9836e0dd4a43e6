"""The node's one upstream ``ReduceStream``, reopened when it breaks.

A node aggregator (:mod:`lossreduce.client.aggregator`) sends the coordinator
its rounds over this stream: the client's own
:class:`~lossreduce.client._stream.ReduceStreamSession` on the client's channel
(token, TLS, keepalive from the settings), with the client's backoff and retry
budget. When the stream breaks, a new one is opened and every request still
unanswered is sent again, unchanged: the coordinator answers an identical
re-sent contribution with the round's one outcome, so a round decided while
the stream was down is answered from the coordinator's stored outcome, and
nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

import grpc
from google.rpc import code_pb2, status_pb2

from lossreduce.client._stream import ReduceStreamSession, StreamBrokenError
from lossreduce.client._transport import call_metadata, open_channel, status_of
from lossreduce.client.retry import Backoff, RetryBudget
from lossreduce.client.settings import ClientSettings
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["UpstreamStream", "node_failure"]

_ROUND_CODES = frozenset(
    [
        code_pb2.INVALID_ARGUMENT,
        code_pb2.FAILED_PRECONDITION,
        code_pb2.ABORTED,
        code_pb2.ALREADY_EXISTS,
        code_pb2.RESOURCE_EXHAUSTED,
    ]
)
"""Status codes that are the coordinator's answer to a round, not a transport failure."""


def node_failure(request: pb.ReduceRequest, code: int, message: str) -> pb.ReduceResponse:
    """The node's own answer when it could not get the coordinator's."""
    return pb.ReduceResponse(
        round=request.round, error=status_pb2.Status(code=code, message=message)
    )


class UpstreamStream:
    """The node's one ``ReduceStream`` to the coordinator: the client's stream
    session, reopened when it breaks, every unanswered request sent again on the
    new one (the coordinator answers an identical re-sent contribution with the
    round's one outcome)."""

    def __init__(
        self, target: str, settings: ClientSettings, on_reconnect: Callable[[], None]
    ) -> None:
        self.target = target
        self.settings = settings
        self._on_reconnect = on_reconnect
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ReductionCoordinatorStub | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._session: ReduceStreamSession | None = None
        self._backoff = Backoff.from_settings(settings)
        self._rng = random.Random()
        self._closed = asyncio.Event()
        self._down_since: float | None = None
        # Loop time the coordinator became unreachable, None while it answers. Every
        # request's retry budget counts from it: a rank's client retries the node's
        # UNAVAILABLE, and a fresh budget per re-send would stack the node's budget on
        # the rank's (a silent partition then took detection + 3 budgets to report).

    def open(self) -> None:
        if self._channel is None and not self._closed.is_set():
            self._channel = open_channel(self.target, self.settings)
            self._stub = pb_grpc.ReductionCoordinatorStub(self._channel)
            self._metadata = call_metadata(self.settings)

    async def close(self) -> None:
        self._closed.set()
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _current(self) -> ReduceStreamSession:
        """The open stream, or a new one when the last broke."""
        assert self._stub is not None, "open() runs before anything is submitted"
        current = self._session
        if current is not None and not current.broken:
            return current
        session = self._session = ReduceStreamSession(
            self._stub.ReduceStream(metadata=self._metadata)
        )
        if current is not None:
            self._on_reconnect()
            await current.close()
        return session

    async def submit(self, request: pb.ReduceRequest) -> tuple[pb.ReduceResponse, bool]:
        """The coordinator's answer to ``request`` and False; or, when there is none
        to be had (retry budget spent, credentials refused, call deadline, closed),
        the node's own failure naming the coordinator, and True."""
        loop = asyncio.get_running_loop()
        budget = RetryBudget(
            self._backoff,
            self.settings.retry_budget_s,
            self._rng,
            first_failure_at=self._down_since,
        )
        where = f"the coordinator at {self.target}"
        via_stream = True
        while True:
            if self._closed.is_set():
                return node_failure(
                    request, code_pb2.CANCELLED, "the node aggregator was closed"
                ), True
            budget.record_attempt()
            try:
                response = await asyncio.wait_for(
                    self._attempt(request, via_stream), self.settings.call_timeout_s
                )
            except StreamBrokenError:
                # As the client does: finish this request with one unary Reduce at once;
                # that call's own status (UNAVAILABLE, UNAUTHENTICATED...) says whether to
                # back off or to give up. How a stream broke can be a race (INTERNAL).
                via_stream = False
                continue
            except asyncio.TimeoutError:
                return node_failure(
                    request,
                    code_pb2.DEADLINE_EXCEEDED,
                    f"no answer from {where} within the node's call timeout of "
                    f"{self.settings.call_timeout_s:g} s",
                ), True
            except grpc.aio.AioRpcError as exc:
                status = status_of(exc)
            else:
                if response.error.code != code_pb2.UNAVAILABLE:
                    self._down_since = None
                    return response, False
                status = response.error
            via_stream = True
            if self._closed.is_set():
                continue
            if status.code != code_pb2.UNAVAILABLE:
                self._down_since = None  # the coordinator answered, if with a refusal
            if status.code in _ROUND_CODES:
                # The coordinator's answer to the round, as a unary call carries it.
                return pb.ReduceResponse(round=request.round, error=status), False
            if status.code != code_pb2.UNAVAILABLE:
                # Credentials refused, a message too large...: retrying cannot help. The
                # status keeps its code and details, so a rank decodes the same class.
                refused = status_pb2.Status()
                refused.CopyFrom(status)
                refused.message = f"{where} refused the node's request: {status.message}"
                return pb.ReduceResponse(round=request.round, error=refused), True
            delay = budget.failed(loop.time())
            if self._down_since is None:
                self._down_since = budget.first_failure_at
            if delay is None:
                return node_failure(
                    request,
                    code_pb2.UNAVAILABLE,
                    f"{where} is unavailable to the node; gave up after {budget.attempts} "
                    f"attempt{'s' if budget.attempts != 1 else ''} over "
                    f"{budget.elapsed(loop.time()):.1f} s (last error: "
                    f"{code_pb2.Code.Name(status.code)}: {status.message or 'no details'})",
                ), True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), delay)

    async def _attempt(self, request: pb.ReduceRequest, via_stream: bool) -> pb.ReduceResponse:
        if via_stream:
            session = await self._current()
            return await session.submit(request)
        assert self._stub is not None, "open() runs before anything is submitted"
        response: pb.ReduceResponse = await self._stub.Reduce(
            request, timeout=self.settings.call_timeout_s, metadata=self._metadata
        )
        return response
