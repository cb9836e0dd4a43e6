"""The coordinator's one settings model: CLI flags and ``LOSSREDUCE_*`` variables.

Every field maps onto a ``lossreduce serve`` flag (``round_timeout_s`` ->
``--round-timeout-s``; see :mod:`lossreduce.settings_cli`) and onto an environment
variable (``LOSSREDUCE_ROUND_TIMEOUT_S``). Flags win over the environment,
which wins over the defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["SERVE_JOURNAL", "CoordinatorSettings"]

SERVE_JOURNAL = Path("lossreduce-journal.sqlite3")
"""The journal ``lossreduce serve`` keeps (in its working directory) unless ``--journal``
or LOSSREDUCE_JOURNAL says otherwise; also :class:`~lossreduce.server.journal.JournalSettings`'
default path."""


class CoordinatorSettings(BaseSettings):
    """How the reduction coordinator listens, times out rounds and bounds its state."""

    model_config = SettingsConfigDict(env_prefix="LOSSREDUCE_", frozen=True, extra="forbid")

    host: str = Field(
        default="127.0.0.1",
        description="Address the gRPC and metrics servers bind to; 0.0.0.0 to listen on every interface.",
    )
    port: int = Field(
        default=50051,
        ge=0,
        le=65535,
        description="gRPC port; 0 picks a free port (printed at start).",
    )
    metrics_port: int | None = Field(
        default=9464,
        ge=0,
        le=65535,
        description="Port of the Prometheus /metrics endpoint; 0 picks a free port; unset (None, "
        "or 'off' on the command line) disables it.",
    )
    round_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Seconds from a round's first arrival until it is aborted naming the missing ranks.",
    )
    retained_steps: int = Field(
        default=1024,
        ge=1,
        description="Steps per group kept answerable: a step this far behind the newest step of "
        "its group is refused as stale instead of opening a new round.",
    )
    finished_cache_size: int = Field(
        default=256,
        ge=1,
        description="Finished rounds per group whose outcome stays in memory, so a retry after "
        "completion gets the same answer; older steps are refused as stale.",
    )
    max_rounds_in_flight: int = Field(
        default=64,
        ge=1,
        description="Rounds of one group that may collect at the same time (pipelining).",
    )
    max_groups_per_job: int = Field(
        default=64, ge=1, description="Groups one job may use at the same time."
    )
    max_jobs: int = Field(
        default=256, ge=1, description="Jobs the coordinator tracks at the same time."
    )
    max_terms: int = Field(default=64, ge=1, description="Loss terms one contribution may carry.")
    max_world_size: int = Field(
        default=65536, ge=1, description="Largest accepted world size of a round."
    )
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Largest gRPC message accepted or sent, in bytes.",
    )
    idle_group_ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="A group with no round in flight for this many seconds is forgotten "
        "(its finished rounds and stale-step window with it).",
    )
    shutdown_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="On SIGTERM, seconds in-flight rounds may still complete before they are "
        "answered UNAVAILABLE.",
    )
    keepalive_time_s: float = Field(
        default=10.0,
        gt=0,
        description="Seconds between HTTP/2 keepalive pings the server sends. A client whose "
        "connection goes quiet without a reset (its link down, its packets dropped) is "
        "disconnected within keepalive_time_s + keepalive_timeout_s (15 s by default), which "
        "releases its streams.",
    )
    keepalive_timeout_s: float = Field(
        default=5.0, gt=0, description="Seconds to wait for a keepalive ping's ack before closing."
    )
    keepalive_min_ping_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="Shortest interval between client pings the server tolerates; a client pinging "
        "more often is sent GOAWAY. Clients' keepalive_time_s must not be shorter.",
    )
    # -- reliability and security (see the README, "Guarantees") --
    journal: Path | None = Field(
        default=None,
        description="SQLite journal of finished rounds, written before any rank is answered; a "
        "coordinator restarted on it answers retried contributions identically. `lossreduce "
        f"serve` defaults to ./{SERVE_JOURNAL} ('none' turns it off); embedded "
        "coordinators (CoordinatorThread) keep none unless set.",
    )
    journal_sync: Literal["normal", "full"] = Field(
        default="normal",
        description="SQLite synchronous mode of the journal: 'normal' survives the process being "
        "killed; 'full' also survives power loss (one fsync per finished round).",
    )
    journal_retain_rounds: int = Field(
        default=10_000,
        ge=1,
        description="Newest finished rounds per (job, group) the journal keeps.",
    )
    journal_retain_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds a finished round stays in the journal (the one default of the "
        "journal's retention). Only retries need it, so keep it above the clients' retry budget "
        "plus a restart; a rerun of a job name after this long starts afresh.",
    )
    token_file: Path | None = Field(
        default=None,
        description="File of accepted bearer tokens, one per line, optionally followed by the "
        "comma-separated jobs the token may use (see lossreduce.server.auth).",
    )
    token: SecretStr | None = Field(
        default=None,
        description="One more accepted token line (LOSSREDUCE_TOKEN only, never a flag: command "
        "lines are visible to every user).",
    )
    tls_cert: Path | None = Field(
        default=None, description="PEM certificate chain of the server; with tls_key, turns on TLS."
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert.")
    tls_client_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle; clients must present a certificate it signed (mutual TLS).",
    )
    insecure: bool = Field(
        default=False,
        description="Allow listening on a non-loopback host without a token or TLS (a trusted "
        "network); otherwise the coordinator refuses to start.",
    )
    max_name_length: int = Field(
        default=128,
        ge=1,
        description="Longest accepted job or group name, in characters (names must be printable).",
    )
    max_contract_length: int = Field(
        default=256, ge=1, description="Longest accepted contract string of one term."
    )
