"""The exact single-process M2PO rule: exact sums, the reference, and AReaL's index rule."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import ReductionInputError, UsageError
from lossreduce.trainer_worker.m2po import m2_values, m2po_cutoff_reference, m2po_keep_reference
from lossreduce.trainer_worker.m2po.exact import (
    decompose,
    exact_segment_sums,
    exact_sum_units,
    ulp_exponent,
)
from tests.trainer_worker.m2po.oracle import areal_index_rule_kept, value_rule_kept

finite_m2 = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_subnormal=True)
# Few distinct values, so that ties are common, around a threshold of 0.04.
tied_m2 = st.sampled_from([0.0, 5e-324, 1e-300, 0.01, 0.02, 0.04, 0.05, 0.09, 0.16, 1.0, 1e300])
thresholds = st.sampled_from([0.0, -1.0, 1e-310, 0.01, 0.04, 0.1, 1.0, math.inf])


def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_worked_example_of_the_docs() -> None:
    # docs/reduction-semantics.md, "The M2PO mask": rank 0 and rank 1's values.
    m2 = f64([0.00, 0.16, 0.04, 0.01, 0.09, 0.02, 0.16])
    cutoff, kept = m2po_cutoff_reference(m2, 0.04)
    assert (cutoff, kept) == (0.09, 5)
    assert m2po_keep_reference(m2, 0.04).tolist() == [True, False, True, True, True, True, False]
    # AReaL's per-micro-batch rule keeps 3 of rank 0's values and 1 of rank 1's.
    assert areal_index_rule_kept([0.00, 0.16, 0.04, 0.01], 0.04) == 3
    assert areal_index_rule_kept([0.09, 0.02, 0.16], 0.04) == 1
    assert areal_index_rule_kept(m2.tolist(), 0.04) == 5


def test_a_tie_across_the_cut_is_dropped_whole() -> None:
    # AReaL's sort keeps one of the two 0.1 tokens (which one is up to the sort);
    # the value rule keeps neither: with both, the mean (0.05) is not below 0.04.
    m2 = f64([0.1, 0.0, 0.1, 0.0])
    assert areal_index_rule_kept(m2.tolist(), 0.04) == 3
    assert m2po_cutoff_reference(m2, 0.04) == (0.0, 2)


def test_every_token_masked_when_the_smallest_is_not_below_the_threshold() -> None:
    m2 = f64([0.05, 0.04, 0.3])
    assert m2po_cutoff_reference(m2, 0.04) == (-math.inf, 0)
    assert not m2po_keep_reference(m2, 0.04).any()
    assert areal_index_rule_kept(m2.tolist(), 0.04) == 1  # AReaL keeps one token there


def test_thresholds_at_the_edges() -> None:
    m2 = f64([0.0, 0.5, 2.0])
    assert m2po_cutoff_reference(m2, math.inf) == (2.0, 3)
    assert m2po_cutoff_reference(m2, 0.0) == (-math.inf, 0)
    assert m2po_cutoff_reference(f64([]), 0.04) == (-math.inf, 0)
    with pytest.raises(UsageError, match=r"m2_threshold=nan"):
        m2po_cutoff_reference(m2, math.nan)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_invalid_values_are_refused_naming_position_and_value(bad: float) -> None:
    with pytest.raises(ReductionInputError, match=rf"m2 value {bad!r} at position 2 "):
        m2po_cutoff_reference(f64([0.0, 0.5, bad, 1.0]), 0.04)


def test_m2_values_are_the_active_tokens_squared_differences_in_float64() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, 0.0]], dtype=torch.float32)
    prox = torch.tensor([[-1.5, -2.0, -0.5], [-0.5, -1.0, 0.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    got = m2_values(old, prox, mask)
    assert got.dtype == torch.float64
    assert got.tolist() == [0.25, 0.0, 0.0625, 0.0]
    with pytest.raises(ReductionInputError, match="must have one shape"):
        m2_values(old, prox[:1], mask)


def exact(values: list[float]) -> Fraction:
    return sum(map(Fraction, values), Fraction(0))


@settings(max_examples=150, deadline=None)
@given(st.lists(finite_m2, max_size=40), st.lists(st.integers(0, 40), max_size=3))
def test_exact_sums_equal_fraction_sums(values: list[float], cuts: list[int]) -> None:
    values = sorted(values)
    unit = min((ulp_exponent(v) for v in values if v > 0), default=0)
    whole, exponent = decompose(f64(values))
    got = exact_sum_units(whole, exponent, unit)
    assert Fraction(got) * Fraction(2) ** unit == exact(values)
    # Consecutive segments, each on the grid of its own smallest value.
    ends = [0, *sorted(min(c, len(values)) for c in cuts), len(values)]
    units = [
        min((ulp_exponent(v) for v in values[a:b] if v > 0), default=0)
        for a, b in itertools.pairwise(ends)
    ]
    sums = exact_segment_sums(whole, exponent, ends, units)
    for (a, b), u, total in zip(itertools.pairwise(ends), units, sums, strict=True):
        assert Fraction(total) * Fraction(2) ** u == exact(values[a:b])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(tied_m2, finite_m2), max_size=30), thresholds)
def test_reference_equals_brute_force(values: list[float], threshold: float) -> None:
    keep = m2po_keep_reference(f64(values), threshold)
    kept = value_rule_kept(values, threshold)
    assert keep.tolist() == [v in kept for v in values]


@settings(max_examples=150, deadline=None)
@given(st.lists(tied_m2, min_size=1, max_size=30), st.sampled_from([0.01, 0.04, 0.1, 1.0]))
def test_value_rule_and_areal_index_rule(values: list[float], threshold: float) -> None:
    # The value rule keeps what AReaL's index rule keeps, less the part of a tie
    # group that AReaL's sort cuts through, and less AReaL's one token when no
    # suffix qualifies.
    _, kept = m2po_cutoff_reference(f64(values), threshold)
    index_kept = areal_index_rule_kept(values, threshold)
    assert kept <= index_kept
    ordered = sorted(values)
    if kept == 0:
        straddled = ordered[0]
    elif kept < len(values):
        straddled = ordered[kept]
    else:
        return
    assert index_kept - kept < ordered.count(straddled) or (kept == 0 and index_kept == 1)
    qualifies = ordered[0] < threshold  # else AReaL's fallback keeps one token
    if qualifies and index_kept < len(values) and ordered[index_kept - 1] != ordered[index_kept]:
        assert kept == index_kept  # no tie across AReaL's cut: the same tokens
