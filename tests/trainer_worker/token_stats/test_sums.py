"""Exact global sums, every rank in one process: exactness, split invariance, edges."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import InvalidPartialError, RoundAbortedError, UsageError
from lossreduce.trainer_worker import LocalNormalizer
from lossreduce.trainer_worker.token_stats import (
    ROUND_STRIDE,
    ExactSum,
    exact_sums_in_process,
    global_exact_sums,
    stats_round_step,
    sums_worst_case_rounds,
)
from lossreduce.trainer_worker.token_stats.wire import LIMB_BITS, MAX_WORLD_SIZE

finite = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True)
# Few distinct values of every kind, so that cancellations and ties are common.
special = st.sampled_from(
    [0.0, -0.0, 5e-324, -5e-324, 1e-300, 0.1, -0.1, 1.0, -1.0, 3.0, 1e16, -1e16, 1e300, -1.7e308]
)


def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def bits(x: float | None) -> bytes | None:
    return None if x is None else struct.pack("<d", x)


def split(values: list[float], ranks: int, owner: list[int]) -> list[torch.Tensor]:
    """``values`` over ``ranks`` ranks: value ``i`` on rank ``owner[i] % ranks``."""
    return [
        f64([v for v, o in zip(values, owner, strict=False) if o % ranks == r])
        for r in range(ranks)
    ]


def rounded(exact: Fraction) -> float:
    """The correctly rounded float of an exact rational (inf beyond the range)."""
    try:
        return exact.numerator / exact.denominator
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(special, finite), max_size=40),
    st.lists(st.integers(0, 5), min_size=40, max_size=40),
    st.integers(1, 6),
)
def test_exact_and_bit_identical_over_any_split(
    values: list[float], owner: list[int], ranks: int
) -> None:
    exact = sum(map(Fraction, values), Fraction(0))
    alone = exact_sums_in_process([{"x": f64(values)}])[0]["x"]
    results = exact_sums_in_process([{"x": part} for part in split(values, ranks, owner)])
    for got in (alone, *(r["x"] for r in results)):
        assert (got.count, got.total) == (len(values), exact)
        assert bits(got.value) == bits(rounded(exact))
        assert bits(got.mean) == bits(rounded(exact / len(values)) if values else None)
        assert got.rounds <= sums_worst_case_rounds(1, ranks)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=30),
    st.lists(st.floats(min_value=-20, max_value=0, width=32), max_size=30),
    st.integers(1, 6),
    st.sampled_from([1, 3, 7, 64]),
)
def test_several_names_share_the_rounds(
    adv: list[float], logp: list[float], ranks: int, max_terms: int
) -> None:
    parts = [
        {
            "adv": torch.tensor(adv[r::ranks], dtype=torch.float32),
            "logp": torch.tensor(logp[r::ranks], dtype=torch.float32),
        }
        for r in range(ranks)
    ]
    results = exact_sums_in_process(parts, max_terms=max_terms)
    for values, name in ((adv, "adv"), (logp, "logp")):
        got = results[ranks - 1][name]
        assert got.total == sum(map(Fraction, values), Fraction(0))
        assert got.count == len(values)
    assert results[0] == results[-1]
    rounds = results[0]["adv"].rounds
    assert rounds == results[0]["logp"].rounds <= sums_worst_case_rounds(2, ranks, max_terms)
    if max_terms == 64:
        # Round 0 and one round of limbs (float32 values need few); none when all are 0.
        assert rounds == (2 if any(adv + logp) else 1)


def test_no_values_anywhere_and_empty_ranks() -> None:
    nothing = exact_sums_in_process([{"x": f64([])}, {"x": f64([])}])[0]["x"]
    assert nothing == ExactSum(count=0, total=Fraction(0), rounds=1)
    assert (nothing.mean, bits(nothing.value)) == (None, bits(0.0))
    one_empty = exact_sums_in_process([{"x": f64([])}, {"x": f64([1.5, -0.25])}])
    assert one_empty[0]["x"] == one_empty[1]["x"]
    assert (one_empty[0]["x"].count, one_empty[0]["x"].mean) == (2, 0.625)
    zeros = exact_sums_in_process([{"x": f64([-0.0])}, {"x": f64([0.0, -0.0])}])[0]["x"]
    assert (zeros.count, zeros.total, bits(zeros.mean), bits(zeros.value)) == (
        3,
        Fraction(0),
        bits(0.0),
        bits(0.0),
    )


def test_huge_and_tiny_magnitudes() -> None:
    huge = exact_sums_in_process([{"x": f64([1.7e308])}, {"x": f64([1.7e308, -1e292])}])[0]["x"]
    assert huge.total == 2 * Fraction(1.7e308) - Fraction(1e292)
    assert huge.value == math.inf  # the exact sum is beyond float64
    assert huge.mean == rounded(huge.total / 3)
    tiny = exact_sums_in_process([{"x": f64([5e-324] * 3)}, {"x": f64([1e308, -1e308])}])[0]["x"]
    assert tiny.total == 3 * Fraction(5e-324)
    assert (tiny.value, tiny.mean) == (1.5e-323, 5e-324)  # 3/5 of the least subnormal rounds up
    third = exact_sums_in_process([{"x": f64([5e-324, 0.0])}, {"x": f64([-0.0])}])[0]["x"]
    assert (third.value, bits(third.mean)) == (5e-324, bits(0.0))  # 1/3 of it rounds to +0.0
    # Values fsum cannot add without rounding: 1e16 + 1 + 1 on three ranks.
    parts = [{"x": f64([1e16])}, {"x": f64([1.0])}, {"x": f64([1.0])}]
    assert exact_sums_in_process(parts)[2]["x"].value == 1.0000000000000002e16


def test_a_mean_is_rounded_once_from_the_exact_quotient() -> None:
    assert ((0.1 + 0.2) + 0.3) / 3 == 0.20000000000000004  # float arithmetic rounds 3 times
    got = exact_sums_in_process([{"x": f64([0.1, 0.2])}, {"x": f64([0.3])}])[0]["x"]
    assert got.mean == rounded((Fraction(0.1) + Fraction(0.2) + Fraction(0.3)) / 3)
    assert got.mean == 0.2


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_an_invalid_value_names_rank_name_position_and_value(bad: float) -> None:
    parts = [{"a": f64([1.0]), "b": f64([0.0, 2.0, bad])}, {"a": f64([]), "b": f64([1.0])}]
    shown = "nan" if math.isnan(bad) else repr(bad)
    with pytest.raises(
        InvalidPartialError,
        match=rf"rank 0: NaN or infinite values \('b': value {shown} at position 2\)",
    ) as err:
        exact_sums_in_process(parts)
    assert err.value.terms == ("b",)
    assert bits(err.value.values[0]) == bits(bad) or math.isnan(bad)
    # Its peers learn who: rank 0 of a world where rank 1 holds the value.
    with pytest.raises(RoundAbortedError, match=r"rank\(s\) \[1\] hold NaN") as aborted:
        exact_sums_in_process(parts[::-1])
    assert aborted.value.ranks == (1,)


def test_refusals_before_any_round() -> None:
    with pytest.raises(UsageError, match="at least one named tensor"):
        exact_sums_in_process([{}])
    with pytest.raises(UsageError, match=r"dtype torch\.int64"):
        exact_sums_in_process([{"x": torch.tensor([1, 2])}])
    with pytest.raises(UsageError, match=r"rank 1 names \['y'\]"):
        exact_sums_in_process([{"x": f64([])}, {"y": f64([])}])
    with pytest.raises(UsageError, match="world_size=8193"):
        exact_sums_in_process([{"x": f64([])}] * (MAX_WORLD_SIZE + 1))
    with pytest.raises(UsageError, match="max_terms=0"):
        exact_sums_in_process([{"x": f64([])}], max_terms=0)


def test_round_keys_and_bounds() -> None:
    assert stats_round_step(3, 0) == 3 * ROUND_STRIDE
    assert stats_round_step(3, ROUND_STRIDE - 1) == 4 * ROUND_STRIDE - 1
    with pytest.raises(UsageError, match="outside"):
        stats_round_step(3, ROUND_STRIDE)
    assert MAX_WORLD_SIZE * 2**LIMB_BITS <= 2**53
    # Two rounds for 4 names at 8 ranks whatever their range (13 terms a name in round 0)...
    assert sums_worst_case_rounds(4, 8, 64, total=8 * 10**6) <= 16
    # ... and the widest values take their worst case when the terms per round are few.
    widest = [{"x": f64([5e-324, -1.7e308] * 4)}, {"x": f64([1e-300, 1e300])}]
    got = exact_sums_in_process(widest, max_terms=8)[0]["x"]
    assert got.total == sum(map(Fraction, [5e-324, -1.7e308] * 4 + [1e-300, 1e300]), Fraction(0))
    assert got.rounds <= sums_worst_case_rounds(1, 2, 8)


def test_one_process_through_the_local_normalizer() -> None:
    values = {"adv": torch.tensor([0.5, -1.25, 3.0]), "w": f64([1e-3, 2e-3])}
    got = global_exact_sums(
        values, LocalNormalizer(job="j", group="g.stats"), 4, rank=0, world_size=1
    )
    assert got == exact_sums_in_process([values])[0]
    assert (got["adv"].mean, got["w"].count) == (0.75, 2)
    with pytest.raises(InvalidPartialError, match=r"step 1024 rank 0: NaN or infinite"):
        global_exact_sums({"x": f64([math.nan])}, LocalNormalizer(), 4, rank=0, world_size=1)
