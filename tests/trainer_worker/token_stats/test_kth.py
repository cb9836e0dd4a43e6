"""The global k-th key, every rank in one process: split invariance, ties, bounds, edges."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import UsageError
from lossreduce.rules import exact_sum
from lossreduce.trainer_worker import LocalNormalizer
from lossreduce.trainer_worker.token_stats import (
    KthKey,
    draw_keys,
    float_order_keys,
    global_kth_smallest,
    kth_smallest_in_process,
    kth_worst_case_rounds,
    seed_of,
    wire,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
int64 = st.integers(INT64_MIN, INT64_MAX)
# Few distinct keys, the ends of the range among them: ties and extremes are common.
tied = st.sampled_from(
    [INT64_MIN, INT64_MIN + 1, -5, -1, 0, 1, 2, 1 << 40, INT64_MAX - 1, INT64_MAX]
)


def i64(keys: list[int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64)


def expected(keys: list[int], k: int) -> tuple[int | None, int]:
    """(threshold, selected) from the sorted union: the min(k, total)-th key, keys <= it."""
    ordered = sorted(keys)
    target = min(k, len(ordered))
    if target == 0:
        return None, 0
    threshold = ordered[target - 1]
    return threshold, sum(key <= threshold for key in ordered)


def check(parts: list[torch.Tensor], k: int, max_terms: int = 64) -> KthKey:
    union = [key for part in parts for key in part.tolist()]
    results = kth_smallest_in_process(parts, k, max_terms=max_terms)
    assert len({(r.threshold, r.selected, r.total, r.rounds) for r in results}) == 1, results
    got = results[0]
    assert (got.threshold, got.selected) == expected(union, k)
    assert (got.total, got.k) == (len(union), k)
    assert got.rounds <= kth_worst_case_rounds(max_terms)
    assert got.terms_sent <= max_terms * got.rounds
    selected = sum(int(r.select(part).sum()) for r, part in zip(results, parts, strict=True))
    assert selected == got.selected
    return got


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(tied, int64), max_size=40),
    st.lists(st.integers(0, 5), min_size=40, max_size=40),
    st.integers(1, 6),
    st.integers(0, 45),
    st.sampled_from([2, 3, 5, 64]),
)
def test_any_split_gives_the_kth_key_of_the_union(
    keys: list[int], owner: list[int], ranks: int, k: int, max_terms: int
) -> None:
    parts = [
        i64([key for key, o in zip(keys, owner, strict=False) if o % ranks == r])
        for r in range(ranks)
    ]
    check(parts, k, max_terms)


def test_edges_no_keys_one_empty_rank_and_k_beyond_the_total() -> None:
    nothing = check([i64([]), i64([])], 3)
    assert (nothing.threshold, nothing.selected, nothing.total, nothing.rounds) == (None, 0, 0, 1)
    assert not nothing.select(i64([1, 2])).any()
    assert check([i64([]), i64([7, -3, 9])], 2).threshold == 7
    beyond = check([i64([4, 1]), i64([]), i64([9])], 10)
    assert (beyond.threshold, beyond.selected, beyond.total) == (9, 3, 3)
    none = check([i64([4, 1]), i64([9])], 0)
    assert (none.threshold, none.selected, none.rounds) == (None, 0, 1)
    ends = check([i64([INT64_MAX, INT64_MIN]), i64([INT64_MIN])], 2)
    assert (ends.threshold, ends.selected) == (INT64_MIN, 2)
    assert check([i64([INT64_MAX, INT64_MIN]), i64([INT64_MIN])], 3).threshold == INT64_MAX


def test_ties_at_the_threshold_are_kept_together() -> None:
    # The 3rd smallest is 5, and so are the 4th to 12th: all ten are selected.
    parts = [i64([5] * 4 + [1]), i64([5] * 6), i64([2, 100])]
    got = check(parts, 3)
    assert (got.threshold, got.selected) == (5, 12)
    assert got.select(parts[2]).tolist() == [True, False]


def test_top_k_by_value_with_float_order_keys() -> None:
    # The 3 largest covariances, -0.0 and 0.0 tied, over two ranks.
    cov = [torch.tensor([0.5, -0.0, -2.0, 3.0]), torch.tensor([0.0, 3.0, 0.25])]
    got = kth_smallest_in_process([float_order_keys(-c) for c in cov], 3)[0]
    masks = [got.select(float_order_keys(-c)) for c in cov]
    assert [m.tolist() for m in masks] == [[True, False, False, True], [False, True, False]]
    got = kth_smallest_in_process([float_order_keys(-c) for c in cov], 4)[0]
    assert got.selected == 4  # 3.0, 3.0, 0.5, 0.25
    got = kth_smallest_in_process([float_order_keys(-c) for c in cov], 5)[0]
    assert got.selected == 6  # ... and both zeros, one key


def test_a_seeded_draw_is_the_same_in_every_layout() -> None:
    rows, positions = torch.arange(64)[:, None], torch.arange(32)[None, :]
    keys = draw_keys(seed_of("job", "actor", 3, "clip_cov"), rows, positions)  # [64, 32]
    alone = kth_smallest_in_process([keys.reshape(-1)], 100)[0]
    drawn = alone.select(keys)
    assert int(drawn.sum()) == alone.selected == 100
    for ranks in (2, 3, 8):
        shards = [keys[r::ranks] for r in range(ranks)]  # rows dealt round-robin
        results = kth_smallest_in_process(shards, 100)
        assert results[0].threshold == alone.threshold
        for r, (res, shard) in enumerate(zip(results, shards, strict=True)):
            assert torch.equal(res.select(shard), drawn[r::ranks])


def test_many_keys_over_eight_ranks_in_few_rounds() -> None:
    gen = torch.Generator().manual_seed(5)
    keys = draw_keys(11, torch.arange(40_000))
    cov = torch.randn(40_000, generator=gen, dtype=torch.float64) * 1e-3
    for values in (keys, float_order_keys(-cov)):
        for k in (1, 80, 20_000, 39_999):
            got = check(list(values.chunk(8)), k)
            assert got.rounds <= 7, got


def test_refusals_and_bounds() -> None:
    with pytest.raises(UsageError, match="k=-1"):
        kth_smallest_in_process([i64([1])], -1)
    with pytest.raises(UsageError, match="k=True"):
        kth_smallest_in_process([i64([1])], True)
    with pytest.raises(UsageError, match="float_order_keys"):
        kth_smallest_in_process([torch.tensor([1.0])], 1)
    with pytest.raises(UsageError, match="max_terms=1"):
        kth_smallest_in_process([i64([1])], 1, max_terms=1)
    with pytest.raises(UsageError, match="world_size=0"):
        kth_smallest_in_process([], 1)
    assert [kth_worst_case_rounds(m) for m in (2, 64, 128, 256)] == [64, 11, 10, 8]
    # Narrow int32 keys are int64 keys too.
    assert check([torch.tensor([3, 1], dtype=torch.int32), i64([2])], 2).threshold == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=7, max_size=7), min_size=1, max_size=6))
def test_packed_counts_sum_exactly_over_ranks(per_rank: list[list[int]]) -> None:
    # Each rank's counts of 7 segments, packed into terms in a base above the
    # global count plus the + 1s, summed as the backends sum, unpacked.
    world = len(per_rank)
    base = sum(map(sum, per_rank)) + world + 1
    digits = wire.digits_per_term(base)
    assert base**digits <= 2**53 < base ** (digits + 1)
    packed = [wire.pack_counts(counts, base, digits) for counts in per_rank]
    totals = [exact_sum(terms[i] for terms in packed) for i in range(len(packed[0]))]
    assert len(totals) == -(-7 // digits)
    want = [sum(counts[i] for counts in per_rank) for i in range(7)]
    assert wire.unpack_counts(totals, base, digits, 7, world) == want


def test_a_tie_at_the_low_end_of_the_bracket_over_six_ranks() -> None:
    # The first round's 11th segment is (INT64_MIN - 1 + 10 * 2**58, ... ]; the next
    # round packs its counts as digits, and one digit holds all 18 keys of the bracket:
    # the base must exceed the bracket's count.
    key = INT64_MIN + 10 * 2**58
    got = check([i64([key] * 3) for _ in range(6)], 7)
    assert (got.threshold, got.selected) == (key, 18)


def test_one_process_through_the_local_normalizer() -> None:
    keys = draw_keys(3, torch.arange(500))
    got = global_kth_smallest(keys, 20, LocalNormalizer(), 9, rank=0, world_size=1)
    want = kth_smallest_in_process([keys], 20)[0]
    assert (got.threshold, got.selected, got.rounds) == (want.threshold, 20, want.rounds)
    assert got.threshold == int(torch.sort(keys).values[19])
