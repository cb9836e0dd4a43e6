"""Bytes that are not a request get INVALID_ARGUMENT, not an internal error.

gRPC parses each message with the method's deserializer before the servicer
runs; on bytes that are not a valid protobuf message (or hold invalid UTF-8
in a string field) it answers UNKNOWN and logs a traceback per message. This
interceptor swaps in a deserializer that turns such bytes into an
:class:`Undecodable` marker, answered with ``INVALID_ARGUMENT``
(``InvalidPartialError``) naming the method and the parse error. Undecodable
bytes name no round, so a stream answers the requests before them and then
ends with that status.

The contribution methods (``Reduce``, ``ReduceStream``) answer markers in the
servicer itself, which looks at every request anyway: wrapping them here
would add a coroutine per call and two async-generator layers per stream
message for a check that is one ``isinstance``. Only the other methods get
the checking wrapper.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_status import rpc_status

from lossreduce.errors import InvalidPartialError
from lossreduce.status_codec import to_status

from .handler_wrap import Handler, checked, with_behavior

__all__ = ["SELF_CHECKING_METHODS", "MalformedRequestInterceptor", "Undecodable"]

_SERVICE = "/lossreduce.v2.ReductionCoordinator/"

SELF_CHECKING_METHODS: frozenset[str] = frozenset({"Reduce", "ReduceStream"})
"""Methods whose servicer answers :class:`Undecodable` markers itself."""


class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("reason", "size")

    def __init__(self, size: int, reason: str) -> None:
        self.size = size
        self.reason = reason

    def status(self, method: str) -> grpc.Status:
        """The INVALID_ARGUMENT status answering this marker on ``method`` (its short
        name, ``ReduceStream``, or the full path)."""
        path = method if method.startswith("/") else _SERVICE + method
        err = InvalidPartialError(
            f"{path}: a {self.size}-byte message is not a valid request: {self.reason}"
        )
        return rpc_status.to_status(to_status(err))


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Undecodable(len(data), str(exc))

    return deserialize


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers undecodable requests to the coordinator's methods with INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if (
            handler is None
            or not method.startswith(_SERVICE)
            or handler.request_deserializer is None
        ):
            return handler
        # The registered handler of a method is one object: wrap it once, not per call.
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(method: str, handler: Handler) -> Handler:
        """``handler`` with a tolerant deserializer and, unless its servicer looks for
        markers itself, a check for them."""
        tolerant = _tolerant(handler.request_deserializer)
        if method.removeprefix(_SERVICE) in SELF_CHECKING_METHODS:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_unary
            return with_behavior(handler, behavior, tolerant)

        def well_formed(request: Any) -> grpc.Status | None:
            return request.status(method) if isinstance(request, Undecodable) else None

        return checked(handler, well_formed, tolerant)
