"""Hierarchical aggregation: exact expansions, the round table's aggregated
contributions, the aggregator's fallback, and nodes against a real coordinator."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.client.aggregator import AggregatorSettings, NodeAggregator, node_requests
from lossreduce.client.expansion import ExpansionOverflowError, exact_expansion
from lossreduce.contribution import Contribution
from lossreduce.errors import (
    ConflictingContributionError,
    InvalidPartialError,
    RoundAbortedError,
)
from lossreduce.server.metrics import CoordinatorMetrics
from lossreduce.server.outcomes import Outcome, OutcomeKind, RoundKey
from lossreduce.server.round_table import Round, RoundTable
from lossreduce.server.settings import CoordinatorSettings
from lossreduce.v2 import coordinator_pb2 as pb

KEY = RoundKey("job", "actor", 1)
TERMS = ("tokens", "groups")
CONTRACTS = ("sum:token_mean", "mean:prompt_mean")

partial_values = st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)


# No per-example deadline: the machine's CPUs are shared, and a slow example is no bug.
@settings(deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), max_size=40))
def test_expansion_is_exact_nonoverlapping_and_increasing(values):
    try:
        expansion = exact_expansion(values)
    except ExpansionOverflowError:
        return
    assert math.fsum(expansion) == math.fsum(values)
    assert sum(map(Fraction, expansion)) == sum(map(Fraction, values))
    assert 0.0 not in expansion
    for small, big in itertools.pairwise(expansion):
        assert abs(small) < abs(big)


@given(
    st.lists(st.lists(partial_values, min_size=2, max_size=2), min_size=1, max_size=64),
    st.randoms(use_true_random=False),
)
def test_fsum_over_node_expansions_is_bit_identical_to_fsum_over_ranks(rows, rng):
    """However ranks are grouped into nodes, the global sum is the flat fsum."""
    world = len(rows)
    cuts = sorted(rng.sample(range(1, world), k=rng.randint(0, world - 1))) if world > 1 else []
    nodes = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, world], strict=True)]
    for t in range(2):
        flat = math.fsum(row[t] for row in rows)
        components = [x for node in nodes for x in exact_expansion([row[t] for row in node])]
        assert math.fsum(components).hex() == flat.hex()


def test_expansion_overflow_is_reported():
    with pytest.raises(ExpansionOverflowError, match="overflows"):
        exact_expansion([1.7e308, 1.7e308])


def aggregate(ranks, values_by_rank, world):
    key = pb.RoundKey(job="job", group="actor", step=1)
    contributions = [
        Contribution(r, world, TERMS, tuple(values_by_rank[r]), CONTRACTS) for r in ranks
    ]
    (request,) = node_requests(key, contributions)
    return request


as_contribution = Contribution.from_request


def single(rank, world, values):
    return Contribution(rank, world, TERMS, tuple(values), CONTRACTS)


def table() -> RoundTable:
    return RoundTable(CoordinatorSettings(port=0, metrics_port=None))


def round_of(t: RoundTable) -> Round:
    rnd = t.lookup(KEY)
    assert rnd is not None
    return rnd


def outcome_of(t: RoundTable) -> Outcome:
    outcome = round_of(t).outcome
    assert outcome is not None
    return outcome


@settings(max_examples=60)
@given(st.lists(st.lists(partial_values, min_size=2, max_size=2), min_size=4, max_size=24))
def test_round_of_aggregates_and_single_ranks_equals_the_flat_round(rows):
    world = len(rows)
    flat_table, agg_table = table(), table()
    for r in range(world):
        flat_table.contribute(KEY, single(r, world, rows[r]), 0.0)
    # Ranks 0..2 arrive as one aggregate, rank 3 alone, the rest as a second aggregate.
    agg_table.contribute(KEY, as_contribution(aggregate([0, 1, 2], rows, world)), 0.0)
    agg_table.contribute(KEY, single(3, world, rows[3]), 0.0)
    if world > 4:
        agg_table.contribute(KEY, as_contribution(aggregate(range(4, world), rows, world)), 0.0)
    flat, agg = flat_table.lookup(KEY), agg_table.lookup(KEY)
    assert flat is not None
    assert agg is not None
    assert agg.outcome is not None
    assert flat.outcome is not None
    assert agg.outcome.kind == flat.outcome.kind
    assert [(n.term, n.value.hex(), n.zero_ranks) for n in agg.outcome.normalizers] == [
        (n.term, n.value.hex(), n.zero_ranks) for n in flat.outcome.normalizers
    ]
    assert agg.arrived_ranks() == list(range(world))


def test_aggregate_counts_zero_ranks_and_answers_retries_identically():
    rows = [[0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [4.0, 5.0]]
    t = table()
    first = as_contribution(aggregate([0, 1, 2], rows, 4))
    t.contribute(KEY, first, 0.0)
    assert round_of(t).missing_ranks() == [3]
    retry = t.contribute(KEY, first, 0.1)
    assert retry.error is None
    t.contribute(KEY, single(3, 4, rows[3]), 0.2)
    outcome = outcome_of(t)
    assert outcome.kind is OutcomeKind.COMPLETED
    assert [(n.value, n.zero_ranks) for n in outcome.normalizers] == [(6.0, 2), (9.0, 1)]
    after = t.contribute(KEY, first, 0.3)
    assert after.error is None
    assert after.round is not None
    assert after.round.outcome is outcome


def test_aggregate_overlapping_arrived_ranks_conflicts():
    rows = [[1.0, 1.0]] * 4
    t = table()
    t.contribute(KEY, single(1, 4, rows[1]), 0.0)
    admission = t.contribute(KEY, as_contribution(aggregate([0, 1], rows, 4)), 0.0)
    assert isinstance(admission.error, ConflictingContributionError)
    assert round_of(t).arrived_ranks() == [1]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"covers": (0, 2, 1)}, "strictly increasing"),
        ({"covers": (0, 1, 9)}, "outside world_size 4"),
        ({"values": (99.0, 3.0)}, "must be the finite sum of the expansion"),
        ({"zero_ranks": (4, 0)}, "zero_ranks 4 of 3 ranks"),
        ({"expansions": ((1.0, math.inf), (3.0,))}, "malformed aggregate"),
        ({"expansions": ((math.inf, -math.inf), (3.0,))}, "malformed aggregate"),
        ({"expansions": ((1.0,), (3.0,)), "zero_ranks": (0,)}, "zero count per term"),
    ],
)
def test_malformed_aggregate_is_invalid_and_aborts_the_round(change, match):
    import dataclasses

    rows = [[1.0, 1.0]] * 4
    t = table()
    t.contribute(KEY, single(3, 4, rows[3]), 0.0)
    bad = dataclasses.replace(as_contribution(aggregate([0, 1, 2], rows, 4)), **change)
    t.contribute(KEY, bad, 0.0)
    outcome = outcome_of(t)
    assert outcome.kind is OutcomeKind.ABORTED_INVALID
    assert isinstance(outcome.culprit, InvalidPartialError)
    assert match in str(outcome.culprit)
    assert isinstance(outcome.error_for(3), RoundAbortedError)


def test_node_requests_fall_back_to_every_rank_when_one_is_invalid_or_disagrees():
    key = pb.RoundKey(job="job", group="actor", step=1)
    good = [Contribution(r, 8, TERMS, (1.0, 2.0), CONTRACTS) for r in (4, 5)]
    nan = Contribution(6, 8, TERMS, (math.nan, 2.0), CONTRACTS)
    other = Contribution(6, 8, TERMS, (1.0, 2.0), ("sum:token_mean", "other"))
    for odd in (nan, other):
        requests = node_requests(key, [*good, odd])
        assert [r.rank for r in requests] == [4, 5, 6]
        assert all(not r.covered_ranks for r in requests)
    (aggregated,) = node_requests(key, [good[1], good[0]])
    assert list(aggregated.covered_ranks) == [4, 5]
    assert [p.value for p in aggregated.partials] == [2.0, 4.0]


def run_nodes(target: str, world: int, per_node: int, values, step: int = 1):
    """Every rank of ``world`` through node aggregators; each rank's result or error."""

    async def main():
        nodes = [
            NodeAggregator(
                target,
                job="agg",
                group="actor",
                local_ranks=range(i * per_node, (i + 1) * per_node),
                world_size=world,
                settings=AggregatorSettings(node_timeout_s=30),
            )
            for i in range(world // per_node)
        ]
        try:
            for node in nodes:
                await node.open()
            order = list(range(world))
            random.Random(step).shuffle(order)
            calls = {
                r: nodes[r // per_node]
                .local_rank(r)
                .reduce(
                    step,
                    dict(zip(TERMS, values[r], strict=True)),
                    dict(zip(TERMS, CONTRACTS, strict=True)),
                )
                for r in order
            }
            results = await asyncio.gather(*calls.values(), return_exceptions=True)
            return dict(zip(calls, results, strict=True))
        finally:
            for node in nodes:
                await node.close()

    return asyncio.run(main())


def test_nodes_against_a_real_coordinator_are_exact_and_name_the_culprit(coordinator):
    world, per_node = 12, 4
    rng = random.Random(7)
    values = [
        [rng.random() * 10 ** rng.randint(-8, 8), float(rng.randint(0, 3))] for _ in range(world)
    ]
    results = run_nodes(coordinator.target, world, per_node, values)
    expected = {t: math.fsum(v[i] for v in values) for i, t in enumerate(TERMS)}
    assert all(results[r] == expected for r in range(world)), results

    values[6][1] = -1.0
    failed = run_nodes(coordinator.target, world, per_node, values, step=2)
    assert isinstance(failed[6], InvalidPartialError)
    assert "rank 6" in str(failed[6])
    for r in set(range(world)) - {6}:
        assert isinstance(failed[r], RoundAbortedError)
        assert failed[r].culprit_rank == 6


@pytest.mark.parametrize(
    ("odd", "reason"),
    [
        (Contribution(6, 8, TERMS, (math.nan, 2.0), CONTRACTS), "nan"),
        (Contribution(6, 8, TERMS, (-1.0, 2.0), CONTRACTS), "negative"),
        (Contribution(6, 8, TERMS, (math.inf, 2.0), CONTRACTS), "infinite"),
        (Contribution(9, 8, TERMS, (1.0, 2.0), CONTRACTS), "rank_out_of_range"),
    ],
)
def test_the_node_and_the_coordinator_judge_a_contribution_alone_alike(odd, reason):
    """What makes the node forward every rank's own request is what the round
    table refuses the culprit for (one judgement, not two)."""
    key = pb.RoundKey(job="job", group="actor", step=1)
    good = Contribution(5, 8, TERMS, (1.0, 2.0), CONTRACTS)
    assert len(node_requests(key, [good, odd])) == 2
    metrics = CoordinatorMetrics()
    t = RoundTable(CoordinatorSettings(port=0, metrics_port=None), observer=metrics)
    t.contribute(KEY, good, 0.0)
    t.contribute(KEY, odd, 0.0)
    outcome = outcome_of(t)
    assert outcome.kind is OutcomeKind.ABORTED_INVALID
    assert outcome.culprit is not None
    assert outcome.culprit.rank == odd.rank
    labels = {"job": KEY.job, "group": KEY.group, "reason": reason}
    assert metrics.registry.get_sample_value("lossreduce_rejected_partials_total", labels) == 1.0
