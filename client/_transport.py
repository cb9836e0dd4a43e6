"""The only place the client touches gRPC channel construction and statuses.

Credentials live here too: :func:`open_channel` turns the TLS settings into
``grpc.ssl_channel_credentials`` and :func:`call_metadata` the bearer token
into the metadata every call carries (plain metadata rather than call
credentials, so a token also works on a plaintext loopback channel).
"""

from __future__ import annotations

from pathlib import Path

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from lossreduce.client.settings import ClientSettings, channel_options
from lossreduce.errors import UsageError

__all__ = ["call_metadata", "channel_credentials", "open_channel", "status_of"]


def _read_pem(field: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"ClientSettings.{field} {str(path)!r} cannot be read: {exc}") from exc


def channel_credentials(settings: ClientSettings) -> grpc.ChannelCredentials | None:
    """TLS credentials from ``settings``, or None for a plaintext channel."""
    if not settings.uses_tls:
        return None
    root = settings.tls_root_cert
    cert, key = settings.tls_client_cert, settings.tls_client_key
    root_pem = settings.tls_root_cert_pem
    if root is not None:
        root_pem = _read_pem("tls_root_cert", root)
    return grpc.ssl_channel_credentials(
        root_certificates=root_pem,
        private_key=None if key is None else _read_pem("tls_client_key", key),
        certificate_chain=None if cert is None else _read_pem("tls_client_cert", cert),
    )


def call_metadata(settings: ClientSettings) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the bearer token, when one is set."""
    if settings.token is None:
        return ()
    return (("authorization", f"Bearer {settings.token.get_secret_value()}"),)


def open_channel(target: str, settings: ClientSettings) -> grpc.aio.Channel:
    """A channel to the coordinator at ``target`` (``host:port``) on the running loop."""
    credentials = channel_credentials(settings)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=channel_options(settings))
    return grpc.aio.secure_channel(target, credentials, options=channel_options(settings))


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
