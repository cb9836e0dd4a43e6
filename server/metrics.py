"""The coordinator's Prometheus metrics, one registry per coordinator.

:class:`CoordinatorMetrics` is the round table's observer: it turns what the
table does into the ``lossreduce_*`` series that ``deploy/`` dashboards and
alerts are written against. Label sets are bounded by job, group, term,
outcome, reason, method and code: never per rank or per step, so a long job
keeps a fixed number of series. A group's series go when the round table
forgets the group (idle for ``idle_group_ttl_s``, none of its rounds live or
cached), so a long-lived coordinator serving many short jobs keeps a bounded
number of series too.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lossreduce import __version__
from lossreduce.metrics_http import MetricsServer

from .outcomes import Outcome, OutcomeKind, RejectReason, RoundKey
from .run_claims import ClaimRecord

__all__ = ["DURATION_BUCKETS_S", "CoordinatorMetrics", "MetricsServer"]

DURATION_BUCKETS_S: tuple[float, ...] = (
    # 100 µs .. 300 s (the default round timeout), roughly x2.5 per bucket.
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
"""Buckets of the round duration and straggler wait histograms, in seconds."""


@dataclass(slots=True)
class _GroupSeries:
    """A group's labelled children, bound once: ``labels()`` per contribution is costly."""

    contributions: Counter
    retries: Counter
    in_flight: Gauge
    duration: Histogram
    straggler: Histogram
    rounds: dict[OutcomeKind, Counter]
    terms: dict[str, tuple[Gauge, Gauge]] = field(default_factory=dict)
    """Per term with a series: its global normalizer and zero-partial-ranks children
    (bound once, not per term per round; removed with the group)."""
    reasons: set[RejectReason] = field(default_factory=set)
    """Reasons with a rejection series (removed with the group)."""


class CoordinatorMetrics:
    """Every coordinator metric, in its own :class:`CollectorRegistry`.

    Implements :class:`lossreduce.server.outcomes.RoundObserver`.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        jg = ("job", "group")
        self.rounds = Counter(
            "lossreduce_rounds", "Rounds finished, by outcome.", (*jg, "outcome"), registry=r
        )
        self.round_duration = Histogram(
            "lossreduce_round_duration_seconds",
            "Seconds from a round's first arrival to its answer.",
            jg,
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.straggler_wait = Histogram(
            "lossreduce_straggler_wait_seconds",
            "Seconds between the last two arrivals of a round (how long the slowest rank held it).",
            jg,
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.contributions = Counter(
            "lossreduce_contributions",
            "New contributions accepted (retries excluded).",
            jg,
            registry=r,
        )
        self.retries = Counter(
            "lossreduce_retries_deduplicated",
            "Identical re-sent contributions answered without counting them again.",
            jg,
            registry=r,
        )
        self.in_flight = Gauge(
            "lossreduce_rounds_in_flight", "Rounds still collecting contributions.", jg, registry=r
        )
        self.global_normalizer = Gauge(
            "lossreduce_global_normalizer",
            "Global normalizer of each term in the group's last completed round.",
            (*jg, "term"),
            registry=r,
        )
        self.zero_partial_ranks = Gauge(
            "lossreduce_zero_partial_ranks",
            "Ranks that sent a zero partial for the term in the group's last completed round.",
            (*jg, "term"),
            registry=r,
        )
        self.rejected = Counter(
            "lossreduce_rejected_partials",
            "Contributions refused, by reason.",
            (*jg, "reason"),
            registry=r,
        )
        self.rpc_errors = Counter(
            "lossreduce_rpc_errors",
            "RPCs answered with an error, by method and gRPC status code.",
            ("method", "code"),
            registry=r,
        )
        self.build_info = Gauge(
            "lossreduce_build_info",
            "Always 1; the labels name the running versions.",
            ("version", "python_version", "grpc_version"),
            registry=r,
        )
        self.build_info.labels(__version__, platform.python_version(), grpc.__version__).set(1)
        # The run is a label of this one series per group only (bounded by the groups),
        # never of the per-round series.
        self.holder_since = Gauge(
            "lossreduce_group_run_claimed_since_seconds",
            "Unix time at which the run holding the job and group claimed it; one series "
            "per group, for the holder only, removed with the group.",
            (*jg, "run"),
            registry=r,
        )
        self._groups: dict[tuple[str, str], _GroupSeries] = {}
        self._holders: dict[tuple[str, str], str] = {}

    def _series(self, key: RoundKey) -> _GroupSeries:
        series = self._groups.get((key.job, key.group))
        if series is None:
            jg = (key.job, key.group)
            series = _GroupSeries(
                contributions=self.contributions.labels(*jg),
                retries=self.retries.labels(*jg),
                in_flight=self.in_flight.labels(*jg),
                duration=self.round_duration.labels(*jg),
                straggler=self.straggler_wait.labels(*jg),
                # Every outcome starts at 0 so that increase() sees a group's
                # first empty round or timeout (a series born at 1 has no rise).
                rounds={kind: self.rounds.labels(*jg, kind.value) for kind in OutcomeKind},
            )
            self._groups[jg] = series
        return series

    # -- RoundObserver ----------------------------------------------------------

    def round_started(self, key: RoundKey) -> None:
        self._series(key).in_flight.inc()

    def contribution_accepted(self, key: RoundKey, *, retry: bool) -> None:
        series = self._series(key)
        (series.retries if retry else series.contributions).inc()

    def contribution_rejected(self, key: RoundKey, reason: RejectReason) -> None:
        self._series(key).reasons.add(reason)
        self.rejected.labels(key.job, key.group, reason.value).inc()

    def round_finished(
        self, key: RoundKey, outcome: Outcome, *, duration_s: float, straggler_wait_s: float | None
    ) -> None:
        series = self._series(key)
        series.in_flight.dec()
        series.rounds[outcome.kind].inc()
        series.duration.observe(duration_s)
        if straggler_wait_s is not None:
            series.straggler.observe(straggler_wait_s)
        for normalizer in outcome.normalizers:
            children = series.terms.get(normalizer.term)
            if children is None:
                labels = (key.job, key.group, normalizer.term)
                children = series.terms[normalizer.term] = (
                    self.global_normalizer.labels(*labels),
                    self.zero_partial_ranks.labels(*labels),
                )
            children[0].set(normalizer.value)
            children[1].set(normalizer.zero_ranks)

    def run_claimed(self, record: ClaimRecord) -> None:
        jg = (record.job, record.group)
        previous = self._holders.get(jg)
        if previous is not None and previous != record.run:
            self.holder_since.remove(*jg, previous)
        self._holders[jg] = record.run
        self.holder_since.labels(*jg, record.run).set(record.since)

    def group_forgotten(self, job: str, group: str) -> None:
        holder = self._holders.pop((job, group), None)
        if holder is not None:
            self.holder_since.remove(job, group, holder)
        series = self._groups.pop((job, group), None)
        if series is None:
            return
        jg = (job, group)
        for metric in (
            self.contributions,
            self.retries,
            self.in_flight,
            self.round_duration,
            self.straggler_wait,
        ):
            metric.remove(*jg)
        for kind in series.rounds:
            self.rounds.remove(*jg, kind.value)
        for term in series.terms:
            self.global_normalizer.remove(*jg, term)
            self.zero_partial_ranks.remove(*jg, term)
        for reason in series.reasons:
            self.rejected.remove(*jg, reason.value)

    # -- the servicer's own -----------------------------------------------------

    def rpc_error(self, method: str, code: grpc.StatusCode) -> None:
        self.rpc_errors.labels(method, code.name).inc()
