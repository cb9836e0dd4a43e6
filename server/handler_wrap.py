"""Wrapping a gRPC method handler: the one mechanism behind the server's interceptors.

A ``grpc.aio.ServerInterceptor`` only sees metadata and the method name; to
look at requests it returns a new handler of the same kind whose behavior
checks each request before the servicer's behavior runs. These helpers build
such handlers once, for unary and bidirectional-stream methods alike.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import grpc

__all__ = ["Check", "Handler", "checked", "refusing", "with_behavior"]

# grpc.RpcMethodHandler; grpc has no type stubs, so mypy sees it as Any anyway.
Handler: TypeAlias = Any
Check = Callable[[Any], grpc.Status | None]
"""Looks at one request: None lets it through, a status refuses it."""


def with_behavior(
    handler: Handler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """A handler of ``handler``'s kind and serializers running ``behavior``."""
    kw = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **kw)
    return grpc.unary_unary_rpc_method_handler(behavior, **kw)


def refusing(handler: Handler, status: grpc.Status) -> Handler:
    """``handler``'s kind, answering every call with ``status``."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort_with_status(status)

    async def refuse_stream(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        await context.abort_with_status(status)
        yield  # never reached; makes this the async generator a streaming handler is

    return with_behavior(handler, refuse_stream if handler.response_streaming else refuse)


def checked(
    handler: Handler,
    check: Check,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """``handler`` with every request passed through ``check`` first.

    Unary-request methods answer a refused request with its status. On a
    bidirectional stream the input ends at the first refused request; the
    requests before it are answered as usual, then the stream ends with the
    refusal's status (aborting from the servicer's reader task instead would
    race with the responses still owed).
    """
    if handler.request_streaming and handler.response_streaming:
        stream = handler.stream_stream

        async def streaming(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            refusal: list[grpc.Status] = []

            async def until_refused() -> AsyncIterator[Any]:
                async for request in requests:
                    status = check(request)
                    if status is not None:
                        refusal.append(status)
                        return
                    yield request

            responses = stream(until_refused(), context)
            if inspect.isawaitable(responses):  # a behavior writing through the context
                await responses
            else:
                async for response in responses:
                    yield response
            if refusal:
                await context.abort_with_status(refusal[0])

        return with_behavior(handler, streaming, request_deserializer)
    # Only unary and bidirectional-stream methods exist in the v2 service.
    assert not handler.request_streaming, "a client-streaming method cannot be checked"
    assert not handler.response_streaming, "a server-streaming method cannot be checked"
    unary = handler.unary_unary

    async def one(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        status = check(request)
        if status is not None:
            await context.abort_with_status(status)
        return await unary(request, context)

    return with_behavior(handler, one, request_deserializer)
