"""The keys of the k-th key search: float order, seeded draws, stable seeds."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import ReductionInputError, UsageError
from lossreduce.trainer_worker.token_stats import draw_keys, float_order_keys, seed_of
from lossreduce.trainer_worker.token_stats.keys import mix64

MASK = (1 << 64) - 1


def signed(value: int) -> int:
    value &= MASK
    return value - (1 << 64) if value >> 63 else value


def splitmix(x: int) -> int:
    """SplitMix64's output for state ``x`` (Steele, Lea, Flood 2014), in Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_mix64_is_splitmix64() -> None:
    # The published first output of SplitMix64 seeded with 0.
    assert mix64(torch.tensor(0)).item() == signed(0xE220A8397B1DCDAF)
    states = [0, 1, 2, -1, 1 << 62, -(1 << 63), (1 << 63) - 1, 123456789]
    got = mix64(torch.tensor(states, dtype=torch.int64)).tolist()
    assert got == [signed(splitmix(s & MASK)) for s in states]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(-(1 << 70), 1 << 70),
    st.lists(st.integers(0, 1 << 40), min_size=1, max_size=6),
    st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=6),
)
def test_draw_keys_chain_splitmix_over_the_ids(seed: int, rows: list[int], cols: list[int]) -> None:
    got = draw_keys(seed, torch.tensor(rows)[:, None], torch.tensor(cols)[None, :])
    assert got.shape == (len(rows), len(cols))
    assert got.dtype == torch.int64
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            key = splitmix(splitmix(splitmix(seed & MASK) ^ row) ^ (col & MASK))
            assert got[i, j].item() == signed(key)


def test_draw_keys_depend_on_the_seed_and_identity_only() -> None:
    rows, positions = torch.arange(50)[:, None], torch.arange(40)[None, :]
    keys = draw_keys(7, rows, positions)
    # Any subset of the tokens, in any order or dtype, gets the same keys.
    assert torch.equal(draw_keys(7, rows[10:20].int(), positions)[3], keys[13])
    assert torch.equal(draw_keys(7, torch.tensor([13]), torch.tensor([5])), keys[13, 5:6])
    # One seed and row: distinct positions give distinct keys (each step is a bijection).
    assert len(set(keys[0].tolist())) == 40
    assert not torch.equal(draw_keys(8, rows, positions), keys)
    # Roughly uniform over int64: about half negative.
    assert 800 < int((keys < 0).sum()) < 1200


def test_draw_keys_refusals() -> None:
    with pytest.raises(UsageError, match="at least one id"):
        draw_keys(1)
    with pytest.raises(UsageError, match=r"torch\.float32"):
        draw_keys(1, torch.tensor([1.0]))
    with pytest.raises(UsageError, match=r"torch\.bool"):
        draw_keys(1, torch.tensor([True]))


floats = st.floats(allow_nan=False, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=300, deadline=None)
@given(floats, floats)
def test_float_order_keys_order_as_the_values(a: float, b: float) -> None:
    ka, kb = float_order_keys(torch.tensor([a, b], dtype=torch.float64)).tolist()
    assert (ka < kb) == (a < b)
    assert (ka == kb) == (a == b)


def test_float_order_keys_edges() -> None:
    values = [-math.inf, -1e308, -1.0, -5e-324, -0.0, 0.0, 5e-324, 1e-300, 1.0, 1e308, math.inf]
    keys = float_order_keys(torch.tensor(values, dtype=torch.float64)).tolist()
    assert keys[4] == keys[5] == 0  # -0.0 and +0.0
    assert keys == sorted(keys)
    assert len(set(keys)) == len(values) - 1
    # float32 and bfloat16 values key as the float64 they convert to, exactly.
    half = torch.tensor([-2.5, 0.1, 3.0], dtype=torch.bfloat16)
    assert torch.equal(float_order_keys(half), float_order_keys(half.double()))
    assert float_order_keys(torch.zeros(2, 0)).shape == (2, 0)


def test_float_order_keys_refuse_nan_naming_its_position() -> None:
    with pytest.raises(ReductionInputError, match=r"value nan at flat position 4 of \(2, 3\)"):
        float_order_keys(torch.tensor([[0.0, 1.0, 2.0], [3.0, math.nan, 5.0]]))
    with pytest.raises(UsageError, match=r"torch.int64"):
        float_order_keys(torch.tensor([1, 2]))


def test_seed_of_is_stable_and_tells_parts_apart() -> None:
    seed = seed_of("job", "actor", 7, "clip_cov")
    assert 0 <= seed < 1 << 64
    assert seed == seed_of("job", "actor", 7, "clip_cov")
    others = {seed_of("a", 1), seed_of("a1"), seed_of(1, "a"), seed_of("a", "1"), seed_of()}
    assert len(others) == 5
    with pytest.raises(UsageError, match="True"):
        seed_of("a", True)
    # Python's own hash of a string is salted per process; the seed is not.
    code = "from lossreduce.trainer_worker.token_stats import seed_of; print(seed_of('job', 7))"
    printed = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": salt},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for salt in ("1", "2")
    }
    assert printed == {str(seed_of("job", 7))}
