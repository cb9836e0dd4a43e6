"""A node agent's settings: where its ranks connect, which ranks it serves, and
(inherited from :class:`~lossreduce.client.aggregation.AggregatorSettings`) how it
talks to the coordinator."""

from __future__ import annotations

from pydantic import Field, field_validator

from lossreduce.client.aggregation import AggregatorSettings

__all__ = ["AgentSettings"]


class AgentSettings(AggregatorSettings):
    """A node agent: where its ranks connect, which ranks it serves, and (inherited)
    how it talks to the coordinator: token, TLS, deadlines, retries, node timeout."""

    node_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds the agent waits for all its local ranks of a round before it hands the "
            "coordinator the ranks that arrived (and each later one as it arrives). Ranks of "
            "one node run in step, so this is short: past it the round only loses its "
            "aggregation, and a round that failed elsewhere (a rank at the wrong agent) "
            "reaches this node's ranks within it."
        ),
    )
    host: str = Field(
        default="127.0.0.1",
        description=(
            "Address the agent listens on for its ranks; they run on the same node, so "
            "loopback by default."
        ),
    )
    port: int = Field(default=0, ge=0, le=65535, description="Port for the ranks; 0 picks one.")
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the agent's Prometheus /metrics endpoint; 0 picks one, None: off.",
    )
    local_ranks: tuple[int, ...] | None = Field(
        default=None,
        description=(
            "Ranks this agent serves (a rank outside them is refused by name). None: the "
            "ranks of its first successful round, which it forwards one by one."
        ),
    )
    shutdown_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="On stop, seconds rounds already sent upstream get to be answered.",
    )

    @field_validator("local_ranks")
    @classmethod
    def _distinct_ranks(cls, ranks: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if ranks is None:
            return None
        if not ranks or min(ranks) < 0 or len(set(ranks)) != len(ranks):
            raise ValueError(f"local_ranks must be distinct ranks >= 0, at least one; got {ranks}")
        return tuple(sorted(ranks))
