"""Property tests of the round table: exact, order-independent sums; every
invalid input answered as documented to every rank."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import (
    EmptyNormalizerError,
    InvalidPartialError,
    RoundAbortedError,
    RoundTimeoutError,
)
from lossreduce.server import (
    Admission,
    Contribution,
    CoordinatorSettings,
    Outcome,
    OutcomeKind,
    RoundKey,
    RoundTable,
)

KEY = RoundKey("job", "group", 3)
TERMS = ("tokens", "sequences", "groups", "kl")
SETTINGS = CoordinatorSettings(round_timeout_s=10.0)

# Finite, >= 0, including 0, subnormals and values near the double's maximum.
partials = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[list[list[float]], list[int], tuple[str, ...]]:
    """Partials [ranks, terms], an arrival order, and the term names."""
    world = draw(st.integers(1, 64))
    n_terms = draw(st.integers(1, len(TERMS)))
    values = draw(
        st.lists(
            st.lists(partials, min_size=n_terms, max_size=n_terms), min_size=world, max_size=world
        )
    )
    order = draw(st.permutations(range(world)))
    return values, list(order), TERMS[:n_terms]


def contribute(
    table: RoundTable, rank: int, world: int, terms: tuple[str, ...], values: list[float]
) -> Admission:
    c = Contribution(rank, world, terms, tuple(values), tuple("mean" for _ in terms))
    return table.contribute(KEY, c, 0.0)


def reference_sum(column: list[float]) -> float:
    """math.fsum in rank order; an out-of-range exact sum rounds to infinity."""
    try:
        return math.fsum(column)
    except OverflowError:
        return math.inf


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_every_rank_gets_fsum_in_rank_order_whatever_the_arrival_order(
    case: tuple[list[list[float]], list[int], tuple[str, ...]],
) -> None:
    values, order, terms = case
    world = len(values)
    table = RoundTable(SETTINGS)
    admissions = {rank: contribute(table, rank, world, terms, values[rank]) for rank in order}
    expected = [reference_sum([row[j] for row in values]) for j in range(len(terms))]
    zeros = [sum(1 for row in values if row[j] == 0.0) for j in range(len(terms))]
    outcomes = set()
    for rank, admission in admissions.items():
        assert admission.round is not None
        outcome = admission.round.outcome
        assert outcome is not None
        outcomes.add(id(outcome))
        if all(0.0 < e < math.inf for e in expected):
            assert outcome.error_for(rank) is None
            assert [n.term for n in outcome.normalizers] == list(terms)
            assert [n.value.hex() for n in outcome.normalizers] == [e.hex() for e in expected]
            assert [n.zero_ranks for n in outcome.normalizers] == zeros
        else:
            err = outcome.error_for(rank)
            assert isinstance(err, EmptyNormalizerError)
            bad = [t for t, e in zip(terms, expected, strict=True) if not 0.0 < e < math.inf]
            assert list(err.terms) == bad
    assert len(outcomes) == 1


bad_values = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -5e-324, -1e308])


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(1, 64),
    data=st.data(),
)
def test_an_invalid_contribution_reaches_every_rank_as_documented(
    world: int, data: st.DataObject
) -> None:
    culprit = data.draw(st.integers(0, world - 1), label="culprit")
    out_of_range = data.draw(st.booleans(), label="rank out of range")
    bad = data.draw(bad_values, label="bad value")
    order = data.draw(st.permutations(range(world)), label="arrival order")
    culprit_at = data.draw(st.integers(0, world - 1), label="culprit arrives at")
    arrivals = [r for r in order if r != culprit]
    arrivals.insert(min(culprit_at, len(arrivals)), culprit)

    table = RoundTable(SETTINGS)
    answers = {}
    for rank in arrivals:
        if rank == culprit:
            c = (
                Contribution(world + culprit, world, ("tokens",), (1.0,), ("mean",))
                if out_of_range
                else Contribution(rank, world, ("tokens",), (bad,), ("mean",))
            )
            admission = table.contribute(KEY, c, 0.0)
            reported = c.rank
        else:
            admission = contribute(table, rank, world, ("tokens",), [1.0])
            reported = rank
        assert admission.error is None
        assert admission.round is not None
        answers[reported] = admission.round

    culprit_rank = world + culprit if out_of_range else culprit
    for rank, rnd in answers.items():
        outcome = rnd.outcome
        assert outcome is not None, f"rank {rank} left waiting"
        assert outcome.kind is OutcomeKind.ABORTED_INVALID
        err = outcome.error_for(rank)
        if rank == culprit_rank:
            assert isinstance(err, InvalidPartialError)
            assert err.rank == culprit_rank
            assert f"rank {culprit_rank}" in err.message
        else:
            assert type(err) is RoundAbortedError
            assert err.culprit_rank == culprit_rank


@settings(max_examples=100, deadline=None)
@given(world=st.integers(1, 64), data=st.data())
def test_timeout_names_exactly_the_ranks_that_never_arrived(
    world: int, data: st.DataObject
) -> None:
    arrived = data.draw(st.sets(st.integers(0, world - 1), max_size=world - 1), label="arrived")
    table = RoundTable(SETTINGS)
    rounds_seen = [contribute(table, r, world, ("tokens",), [1.0]).round for r in sorted(arrived)]
    if not rounds_seen:
        return  # nobody arrived: there is no round to time out
    first = rounds_seen[0]
    assert first is not None
    assert all(rnd is first for rnd in rounds_seen)
    assert table.expire(first.deadline) == [first]
    assert isinstance(first.outcome, Outcome)
    err = first.outcome.error_for(0)
    assert isinstance(err, RoundTimeoutError)
    assert set(err.missing_ranks) == set(range(world)) - arrived
