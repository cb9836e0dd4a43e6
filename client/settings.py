"""Settings of the engine-side client, and the gRPC channel options they imply.

One pydantic model, every field described, so a trainer config can embed it and
validate it once. Credentials (a bearer token, TLS and mutual TLS) are fields
here too; :func:`lossreduce.client._transport.open_channel`, the only place a
channel is created, turns them into channel credentials and call metadata.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

__all__ = ["BASE_CHANNEL_OPTIONS", "ClientSettings", "channel_options"]

BASE_CHANNEL_OPTIONS: Final[tuple[tuple[str, int | str], ...]] = (
    # A worker talks to one coordinator; a dedicated subchannel per client keeps
    # one client's broken connection from failing another client's calls.
    ("grpc.use_local_subchannel_pool", 1),
    # The client retries UNAVAILABLE itself (see retry.py) with its own budget;
    # gRPC's transparent retries would hide attempts from that budget.
    ("grpc.enable_retries", 0),
)
"""Channel options every client uses, whatever its settings."""


class ClientSettings(BaseModel):
    """How a client talks to the coordinator: deadlines, retries, transport."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    call_timeout_s: float = Field(
        default=330.0,
        gt=0,
        description=(
            "Deadline of one attempt of one reduce() call, in seconds. A call waits for "
            "every rank of the round, so keep it above the coordinator's round timeout "
            "(300 s by default): the coordinator then reports missing ranks itself."
        ),
    )
    retry_budget_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "How long one reduce() keeps retrying while the coordinator is unavailable, "
            "in seconds, counted from the first failed attempt. 0 disables retries."
        ),
    )
    initial_backoff_s: float = Field(
        default=0.05, gt=0, description="Delay before the first retry, in seconds."
    )
    max_backoff_s: float = Field(
        default=2.0, gt=0, description="Upper bound of the delay between two retries, in seconds."
    )
    backoff_multiplier: float = Field(
        default=2.0, ge=1.0, description="Factor by which the delay grows after each retry."
    )
    jitter: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description=(
            "Relative random spread of each delay (0.2: +-20%), so many ranks that lost "
            "the coordinator at once do not reconnect in lockstep."
        ),
    )
    use_stream: bool = Field(
        default=True,
        description=(
            "Send contributions over one long-lived ReduceStream per client; False uses "
            "one unary Reduce call per round. A broken stream falls back to Reduce for "
            "the calls it carried."
        ),
    )
    keepalive_time_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Interval of HTTP/2 keepalive pings, in seconds, also on an idle stream between "
            "steps. A connection that goes quiet without a reset (a link down, a switch or "
            "firewall dropping packets) is declared dead within keepalive_time_s + "
            "keepalive_timeout_s (15 s by default; TCP alone would wait many minutes). Keep it "
            "at or above the coordinator's keepalive_min_ping_interval_s (5 s), which sends a "
            "client pinging more often GOAWAY."
        ),
    )
    keepalive_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "How long to wait for a keepalive ping's answer before the connection is "
            "considered dead, in seconds."
        ),
    )
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="Largest message the client sends or accepts, in bytes.",
    )
    token: SecretStr | None = Field(
        default_factory=lambda: _env_secret("LOSSREDUCE_TOKEN"),
        description=(
            "Bearer token sent as 'authorization: Bearer <token>' on every call; defaults to the "
            "LOSSREDUCE_TOKEN environment variable (only its first word: a server-side token "
            "line may list jobs after it). None sends no token."
        ),
    )
    tls: bool = Field(
        default=False,
        description=(
            "Connect over TLS, verifying the coordinator against tls_root_cert (or the system "
            "roots when unset). Implied by any tls_* path."
        ),
    )
    tls_root_cert: Path | None = Field(
        default=None, description="PEM CA bundle the coordinator's certificate must chain to."
    )
    tls_root_cert_pem: bytes | None = Field(
        default=None,
        repr=False,
        description=(
            "PEM CA bundle held in memory instead of a file (e.g. a training run's own CA, "
            "handed over by its driver); takes the place of tls_root_cert, which must then "
            "be unset."
        ),
    )
    tls_client_cert: Path | None = Field(
        default=None,
        description="PEM certificate chain presented to the coordinator (mutual TLS); needs tls_client_key.",
    )
    tls_client_key: Path | None = Field(
        default=None, description="PEM private key of tls_client_cert."
    )
    tls_server_name: str | None = Field(
        default=None,
        description=(
            "Name expected in the coordinator's certificate when it differs from the target's "
            "host (e.g. dialing an IP address)."
        ),
    )

    @property
    def uses_tls(self) -> bool:
        """Whether the channel is TLS (explicitly, or because a TLS file is set)."""
        return self.tls or any(
            path is not None
            for path in (
                self.tls_root_cert,
                self.tls_root_cert_pem,
                self.tls_client_cert,
                self.tls_client_key,
            )
        )

    @model_validator(mode="after")
    def _client_cert_pair(self) -> ClientSettings:
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError(
                "tls_client_cert and tls_client_key go together (mutual TLS needs both); got "
                f"tls_client_cert={self.tls_client_cert} tls_client_key={self.tls_client_key}"
            )
        return self

    @model_validator(mode="after")
    def _one_root(self) -> ClientSettings:
        if self.tls_root_cert is not None and self.tls_root_cert_pem is not None:
            raise ValueError(
                f"tls_root_cert={self.tls_root_cert} and tls_root_cert_pem are two CA bundles; "
                "set one"
            )
        return self

    @model_validator(mode="after")
    def _backoff_bounds(self) -> ClientSettings:
        if self.initial_backoff_s > self.max_backoff_s:
            raise ValueError(
                f"initial_backoff_s={self.initial_backoff_s} must not exceed "
                f"max_backoff_s={self.max_backoff_s}"
            )
        return self


def _env_secret(name: str) -> SecretStr | None:
    words = os.environ.get(name, "").split()
    return SecretStr(words[0]) if words else None


def channel_options(settings: ClientSettings) -> list[tuple[str, int | str]]:
    """The gRPC channel options for ``settings`` (keepalive, sizes, reconnects)."""
    backoff_ms = round(settings.initial_backoff_s * 1000)
    return [
        *BASE_CHANNEL_OPTIONS,
        ("grpc.keepalive_time_ms", round(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(settings.keepalive_timeout_s * 1000)),
        # Without this, an unanswered ping only fails after gRPC's 60 s default.
        ("grpc.http2.ping_timeout_ms", round(settings.keepalive_timeout_s * 1000)),
        # Streams sit idle between steps; keep pinging so a dead coordinator is noticed.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        # Reconnect on the client's own backoff schedule: gRPC's default waits up to
        # 120 s between connection attempts, far longer than the retry budget.
        ("grpc.initial_reconnect_backoff_ms", backoff_ms),
        ("grpc.min_reconnect_backoff_ms", backoff_ms),
        ("grpc.max_reconnect_backoff_ms", round(settings.max_backoff_s * 1000)),
        *(
            [("grpc.ssl_target_name_override", settings.tls_server_name)]
            if settings.tls_server_name
            else []
        ),
    ]
