"""The node agent's Prometheus metrics, one registry per agent.

:class:`AgentMetrics` is the node aggregators' observer
(:class:`~lossreduce.client.aggregator.AggregatorObserver`) plus the agent's
own refusals. Labels are bounded by job, group, reason and code: never a rank
or a step. ``deploy/grafana/lossreduce.json`` (row "Node agents") and
``deploy/prometheus/alerts.yml`` are written against these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lossreduce.client.aggregator import (
    FALLBACK_INVALID,
    FALLBACK_NODE_TIMEOUT,
    FALLBACK_REGROUPED,
    FALLBACK_UNKNOWN_RANKS,
)

__all__ = ["AGENT_DURATION_BUCKETS_S", "AgentMetrics"]

AGENT_DURATION_BUCKETS_S: tuple[float, ...] = (
    # 1 ms .. 300 s (the default round timeout): a round at the agent includes its peers' wait.
    1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
"""Buckets of the agent's round duration histogram, in seconds."""


class AgentMetrics:
    """Every node agent metric, in its own :class:`CollectorRegistry`."""

    def __init__(self, upstream: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rounds_forwarded = Counter(
            "lossreduce_agent_rounds_forwarded",
            "Rounds whose local contributions the agent sent upstream (once per round).",
            ["job", "group"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "lossreduce_agent_fallbacks",
            "Rounds whose local ranks went upstream one by one instead of as one aggregate; "
            "reason: invalid (a local contribution invalid or disagreeing), node_timeout "
            "(local ranks missing at the node deadline), unknown_ranks (still learning them), "
            "regrouped (an aggregate mixed ranks the coordinator had counted with new ones).",
            ["job", "group", "reason"],
            registry=self.registry,
        )
        self.upstream_reconnects = Counter(
            "lossreduce_agent_upstream_reconnects",
            "Times the agent's stream to the coordinator broke and was reopened "
            "(unanswered contributions are re-sent on the new one).",
            ["job", "group"],
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "lossreduce_agent_upstream_failures",
            "Requests the agent answered with its own failure to reach the coordinator "
            "(retry budget spent, credentials refused, deadline), by status code.",
            ["job", "group", "code"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "lossreduce_agent_rejected_requests",
            "Rank requests the agent refused itself; reason: wrong_node (a rank not local "
            "to this agent), wrong_job, aggregate, conflict, unauthenticated.",
            ["job", "group", "reason"],
            registry=self.registry,
        )
        self.round_duration = Histogram(
            "lossreduce_agent_round_duration_seconds",
            "From a round's first local arrival to the last local rank's answer, in seconds.",
            ["job", "group"],
            buckets=AGENT_DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.local_ranks = Gauge(
            "lossreduce_agent_local_ranks",
            "Ranks this agent serves per job and group (0 while they are being learned).",
            ["job", "group"],
            registry=self.registry,
        )
        self.info = Gauge(
            "lossreduce_agent_info",
            "Always 1; labels name the coordinator this agent forwards to.",
            ["upstream"],
            registry=self.registry,
        )
        self.info.labels(upstream).set(1)

    # -- AggregatorObserver -------------------------------------------------------

    def round_forwarded(self, job: str, group: str) -> None:
        self.rounds_forwarded.labels(job, group).inc()

    def fell_back(self, job: str, group: str, reason: str) -> None:
        self.fallbacks.labels(job, group, reason).inc()

    def upstream_reconnected(self, job: str, group: str) -> None:
        self.upstream_reconnects.labels(job, group).inc()

    def upstream_failed(self, job: str, group: str, code: str) -> None:
        self.upstream_failures.labels(job, group, code).inc()

    def round_answered(self, job: str, group: str, seconds: float) -> None:
        self.round_duration.labels(job, group).observe(seconds)

    # -- the agent's own ------------------------------------------------------------

    def request_rejected(self, job: str, group: str, reason: str) -> None:
        self.rejected.labels(job, group, reason).inc()

    def node_known(self, job: str, group: str, ranks: int) -> None:
        self.local_ranks.labels(job, group).set(ranks)

    def group_started(self, job: str, group: str) -> None:
        """Create a new job and group's counters at 0, so their rates and the alerts on
        them have data before the first incident (a series that is born at its first
        increment hides that increment from ``rate`` and ``increase``)."""
        self.rounds_forwarded.labels(job, group)
        self.upstream_reconnects.labels(job, group)
        self.upstream_failures.labels(job, group, "UNAVAILABLE")
        self.rejected.labels(job, group, "wrong_node")
        reasons = (
            FALLBACK_INVALID,
            FALLBACK_NODE_TIMEOUT,
            FALLBACK_REGROUPED,
            FALLBACK_UNKNOWN_RANKS,
        )
        for reason in reasons:
            self.fallbacks.labels(job, group, reason)
