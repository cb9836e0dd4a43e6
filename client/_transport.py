"""The only place the client touches gRPC channel construction and statuses.

Credentials go here: the security issue adds a token and TLS to
:class:`ClientSettings` and turns them into ``grpc.ssl_channel_credentials`` /
call credentials in :func:`open_channel`; nothing else creates a channel.
"""

from __future__ import annotations

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from lossreduce.client.settings import ClientSettings, channel_options

__all__ = ["open_channel", "status_of"]


def open_channel(target: str, settings: ClientSettings) -> grpc.aio.Channel:
    """A channel to the coordinator at ``target`` (``host:port``) on the running loop."""
    return grpc.aio.insecure_channel(target, options=channel_options(settings))


def status_of(exc: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The ``google.rpc.Status`` of a failed call, rich details included.

    Errors raised by gRPC itself (no coordinator reached, deadline) have no
    details; their code and message are still kept.
    """
    try:
        rich = rpc_status.from_call(exc)
    except ValueError:
        # Code or message disagree with the details: trust the call's own status.
        rich = None
    if rich is not None:
        return rich
    return status_pb2.Status(code=exc.code().value[0], message=exc.details() or "")
