"""Coordinator metrics: one test per metric with its label set, and bounded cardinality."""

from __future__ import annotations

import math
import platform

import grpc
import pytest
from prometheus_client import CollectorRegistry

from lossreduce import __version__
from lossreduce.server import (
    Contribution,
    CoordinatorMetrics,
    CoordinatorSettings,
    OutcomeKind,
    RejectReason,
    RoundKey,
    RoundTable,
)
from lossreduce.server.run_claims import ClaimRecord


def c(rank: int, world: int, contract: str = "mean", **terms: float) -> Contribution:
    return Contribution(rank, world, tuple(terms), tuple(terms.values()), (contract,) * len(terms))


@pytest.fixture
def metered() -> tuple[RoundTable, CoordinatorMetrics]:
    metrics = CoordinatorMetrics()
    table = RoundTable(CoordinatorSettings(round_timeout_s=5.0), observer=metrics)
    return table, metrics


def value(metrics: CoordinatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def key(step: int, group: str = "actor") -> RoundKey:
    return RoundKey("job", group, step)


def test_rounds_total_by_every_outcome(metered: tuple[RoundTable, CoordinatorMetrics]) -> None:
    table, metrics = metered
    table.contribute(key(1), c(0, 1, t=1.0), 0.0)  # completed
    table.contribute(key(2), c(0, 1, t=0.0), 0.0)  # rejected_empty
    table.contribute(key(3), c(0, 2, t=math.nan), 0.0)  # aborted_invalid
    rnd = table.contribute(key(4), c(0, 2, t=1.0), 0.0).round
    assert rnd is not None
    table.time_out(rnd, 5.0)  # aborted_timeout
    table.contribute(key(5), c(0, 2, t=1.0), 0.0)
    table.contribute(key(5), c(1, 3, t=1.0), 0.0)  # contract_mismatch
    table.contribute(key(6), c(0, 2, t=1.0), 0.0)
    table.abort_all(1.0)  # aborted_shutdown
    for outcome in OutcomeKind:
        assert (
            value(metrics, "lossreduce_rounds_total", job="job", group="actor", outcome=outcome)
            == 1.0
        )
    assert value(metrics, "lossreduce_rounds_in_flight", job="job", group="actor") == 0.0


def test_every_outcome_series_starts_at_zero_with_the_group(
    metered: tuple[RoundTable, CoordinatorMetrics],
) -> None:
    # increase() over a series born at 1 is 0: the first timeout would be invisible.
    table, metrics = metered
    table.contribute(key(1), c(0, 2, t=1.0), 0.0)
    for outcome in OutcomeKind:
        assert (
            value(metrics, "lossreduce_rounds_total", job="job", group="actor", outcome=outcome)
            == 0.0
        )


def test_round_duration_and_straggler_wait(metered: tuple[RoundTable, CoordinatorMetrics]) -> None:
    table, metrics = metered
    table.contribute(key(1), c(0, 3, t=1.0), 10.0)
    table.contribute(key(1), c(1, 3, t=1.0), 10.25)
    assert value(metrics, "lossreduce_rounds_in_flight", job="job", group="actor") == 1.0
    table.contribute(key(1), c(2, 3, t=1.0), 12.0)
    labels = {"job": "job", "group": "actor"}
    assert value(metrics, "lossreduce_round_duration_seconds_sum", **labels) == 2.0
    assert value(metrics, "lossreduce_straggler_wait_seconds_sum", **labels) == 1.75
    assert value(metrics, "lossreduce_straggler_wait_seconds_bucket", le="1.0", **labels) == 0.0
    assert value(metrics, "lossreduce_straggler_wait_seconds_bucket", le="2.5", **labels) == 1.0
    assert value(metrics, "lossreduce_round_duration_seconds_bucket", le="0.0001", **labels) == 0.0
    assert value(metrics, "lossreduce_round_duration_seconds_bucket", le="300.0", **labels) == 1.0


def test_contributions_and_retries(metered: tuple[RoundTable, CoordinatorMetrics]) -> None:
    table, metrics = metered
    for rank in (0, 0, 1, 1, 1):
        table.contribute(key(1), c(rank, 2, t=1.0), 0.0)
    labels = {"job": "job", "group": "actor"}
    assert value(metrics, "lossreduce_contributions_total", **labels) == 2.0
    assert value(metrics, "lossreduce_retries_deduplicated_total", **labels) == 3.0


def test_global_normalizer_and_zero_partial_ranks_of_last_completed_round(
    metered: tuple[RoundTable, CoordinatorMetrics],
) -> None:
    table, metrics = metered
    for step, (a, b) in enumerate([(1.0, 0.0), (0.0, 0.0), (2.5, 0.0)], start=1):
        table.contribute(key(step), c(0, 3, tok=a, kl=1.0), 0.0)
        table.contribute(key(step), c(1, 3, tok=b, kl=0.0), 0.0)
        table.contribute(key(step), c(2, 3, tok=1.0, kl=0.0), 0.0)
    labels = {"job": "job", "group": "actor"}
    assert value(metrics, "lossreduce_global_normalizer", term="tok", **labels) == 3.5
    assert value(metrics, "lossreduce_global_normalizer", term="kl", **labels) == 1.0
    assert value(metrics, "lossreduce_zero_partial_ranks", term="tok", **labels) == 1.0
    assert value(metrics, "lossreduce_zero_partial_ranks", term="kl", **labels) == 2.0


@pytest.mark.parametrize(
    ("contributions", "reason"),
    [
        ([c(0, 2, t=math.nan)], RejectReason.NAN),
        ([c(0, 2, t=math.inf)], RejectReason.INFINITE),
        ([c(0, 2, t=-1.0)], RejectReason.NEGATIVE),
        ([c(5, 2, t=1.0)], RejectReason.RANK_OUT_OF_RANGE),
        ([Contribution(0, 2, ("t", "t"), (1.0, 1.0), ("m", "m"))], RejectReason.DUPLICATE_TERM),
        ([Contribution(0, 2, ("9x",), (1.0,), ("m",))], RejectReason.BAD_TERM_NAME),
        ([c(0, 2, t=1.0), c(0, 2, t=2.0)], RejectReason.CONFLICTING),
    ],
)
def test_rejected_partials_by_reason(
    metered: tuple[RoundTable, CoordinatorMetrics],
    contributions: list[Contribution],
    reason: RejectReason,
) -> None:
    table, metrics = metered
    for contribution in contributions:
        table.contribute(key(1), contribution, 0.0)
    labels = {"job": "job", "group": "actor", "reason": reason.value}
    assert value(metrics, "lossreduce_rejected_partials_total", **labels) == 1.0


def test_rpc_errors_and_build_info() -> None:
    metrics = CoordinatorMetrics()
    metrics.rpc_error("Reduce", grpc.StatusCode.ABORTED)
    metrics.rpc_error("Reduce", grpc.StatusCode.ABORTED)
    assert value(metrics, "lossreduce_rpc_errors_total", method="Reduce", code="ABORTED") == 2.0
    build = {
        "version": __version__,
        "python_version": platform.python_version(),
        "grpc_version": grpc.__version__,
    }
    assert value(metrics, "lossreduce_build_info", **build) == 1.0


def test_each_coordinator_has_its_own_registry() -> None:
    first, second = CoordinatorMetrics(), CoordinatorMetrics()
    assert first.registry is not second.registry
    first.rpc_error("Reduce", grpc.StatusCode.ABORTED)
    assert value(second, "lossreduce_rpc_errors_total", method="Reduce", code="ABORTED") is None
    shared = CollectorRegistry()
    assert CoordinatorMetrics(shared).registry is shared


def _series(metrics: CoordinatorMetrics) -> int:
    return sum(len(family.samples) for family in metrics.registry.collect())


def test_cardinality_stays_bounded_over_10000_steps() -> None:
    metrics = CoordinatorMetrics()
    table = RoundTable(
        CoordinatorSettings(round_timeout_s=5.0, finished_cache_size=16), observer=metrics
    )
    world = 4

    def run(steps: range) -> None:
        for step in steps:
            for rank in range(world):
                partial = 0.0 if step % 7 == 0 else float(rank + 1)
                table.contribute(key(step), c(rank, world, tok=partial, kl=1.0), float(step))

    run(range(1, 101))
    after_100 = _series(metrics)
    run(range(101, 10_001))
    assert _series(metrics) == after_100
    labels = {"job": "job", "group": "actor"}
    done = value(metrics, "lossreduce_rounds_total", outcome="completed", **labels)
    empty = value(metrics, "lossreduce_rounds_total", outcome="rejected_empty", **labels)
    assert (done, empty) == (10_000 - 10_000 // 7, 10_000 // 7)


def test_a_forgotten_group_takes_every_series_of_its_own_along() -> None:
    metrics = CoordinatorMetrics()
    table = RoundTable(
        CoordinatorSettings(round_timeout_s=5.0, idle_group_ttl_s=60.0), observer=metrics
    )
    before = _series(metrics)
    table.contribute(key(1), c(0, 2, tok=1.0, kl=0.0), 0.0)
    table.contribute(key(1), c(1, 2, tok=2.0, kl=0.0), 0.0)  # completed: every term's gauges
    table.contribute(key(1), c(1, 2, tok=3.0, kl=0.0), 0.0)  # conflicting
    table.contribute(key(2), c(0, 1, tok=math.nan, kl=1.0), 0.0)  # rejected: nan
    table.contribute(key(1, group="critic"), c(0, 2, tok=1.0), 10.0)  # idle from 10 s on
    table.expire(61.0)  # forgets the actor group only
    assert value(metrics, "lossreduce_contributions_total", job="job", group="actor") is None
    assert value(metrics, "lossreduce_contributions_total", job="job", group="critic") == 1.0
    table.expire(71.0)
    assert _series(metrics) == before
    labelled = [
        sample
        for family in metrics.registry.collect()
        for sample in family.samples
        if "job" in sample.labels
    ]
    assert labelled == []
    # A group seen again starts afresh.
    table.contribute(key(3), c(0, 1, tok=1.0), 70.0)
    assert value(metrics, "lossreduce_contributions_total", job="job", group="actor") == 1.0


def test_the_holder_run_is_one_series_per_group_retired_with_the_group() -> None:
    metrics = CoordinatorMetrics()
    name = "lossreduce_group_run_claimed_since_seconds"
    metrics.run_claimed(ClaimRecord("j", "actor", "run-1", 100.0, 0))
    metrics.run_claimed(ClaimRecord("j", "actor", "run-2", 200.0, 5))
    sample = metrics.registry.get_sample_value
    assert sample(name, {"job": "j", "group": "actor", "run": "run-1"}) is None
    assert sample(name, {"job": "j", "group": "actor", "run": "run-2"}) == 200.0
    metrics.group_forgotten("j", "actor")
    assert sample(name, {"job": "j", "group": "actor", "run": "run-2"}) is None
