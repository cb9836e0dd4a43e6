"""The coordinator's one settings model: CLI flags and ``LOSSREDUCE_*`` variables.

Every field maps onto a ``lossreduce serve`` flag (``round_timeout_s`` ->
``--round-timeout``; see :mod:`lossreduce.server.cli`) and onto an environment
variable (``LOSSREDUCE_ROUND_TIMEOUT_S``). Flags win over the environment,
which wins over the defaults.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["CoordinatorSettings"]


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
        default=30.0, gt=0, description="Seconds between HTTP/2 keepalive pings the server sends."
    )
    keepalive_timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds to wait for a keepalive ping's ack before closing."
    )
