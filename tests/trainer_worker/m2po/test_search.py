"""The distributed search, every rank in one process: split invariance, bounds, edges."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import InvalidPartialError, UsageError
from lossreduce.trainer_worker.m2po import (
    DEFAULT_MAX_TERMS,
    M2PO_STEP_STRIDE,
    M2POCut,
    m2po_cutoff_in_process,
    m2po_cutoff_reference,
    m2po_round_step,
    worst_case_rounds,
)
from lossreduce.trainer_worker.m2po.wire import LIMB_BITS, MAX_WORLD_SIZE

finite_m2 = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_subnormal=True)
tied_m2 = st.sampled_from([0.0, 5e-324, 1e-300, 0.01, 0.02, 0.04, 0.05, 0.09, 0.16, 1.0, 1e300])
thresholds = st.sampled_from([0.0, 1e-310, 0.01, 0.04, 0.1, 1.0, math.inf])


def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def check_against_reference(parts: list[torch.Tensor], threshold: float) -> list[M2POCut]:
    union = torch.cat(parts)
    cutoff, kept = m2po_cutoff_reference(union, threshold)
    cuts = m2po_cutoff_in_process(parts, threshold)
    assert len({(c.cutoff, c.kept, c.total, c.rounds) for c in cuts}) == 1, cuts
    cut = cuts[0]
    assert (cut.kept, cut.total) == (kept, union.numel())
    # The cut-off may lie above c*, but below the next larger value: the same tokens.
    assert torch.equal(cut.keep(union), union <= cutoff)
    assert cut.rounds <= worst_case_rounds(max(union.numel(), 1))
    return cuts


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.one_of(tied_m2, finite_m2), max_size=40),
    thresholds,
    st.lists(st.integers(0, 40), max_size=4),
    st.randoms(use_true_random=False),
)
def test_any_split_gives_the_reference_cut(
    values: list[float], threshold: float, cuts_at: list[int], rng
) -> None:
    rng.shuffle(values)
    bounds = [0, *sorted(min(c, len(values)) for c in cuts_at), len(values)]
    parts = [f64(values[a:b]) for a, b in itertools.pairwise(bounds)]
    got = check_against_reference(parts, threshold)
    # The cut-off itself (not only the kept set) is a function of the values alone.
    assert got[0].cutoff == m2po_cutoff_in_process([f64(sorted(values))], threshold)[0].cutoff


def test_many_values_over_eight_ranks_in_few_rounds() -> None:
    gen = torch.Generator().manual_seed(3)
    # Log-normal m2 over many binades, a block of zeros and a tie group.
    m2 = torch.exp(torch.randn(40_000, generator=gen, dtype=torch.float64) * 4) * 0.01
    m2[:2000] = 0.0
    m2[2000:2500] = 0.04
    parts = list(m2[torch.randperm(m2.numel(), generator=gen)].chunk(8))
    cut = check_against_reference(parts, 0.04)[0]
    assert cut.rounds <= 10, cut
    assert cut.wire_bytes == 8 * cut.terms_sent <= 8 * DEFAULT_MAX_TERMS * cut.rounds


def test_a_tie_at_the_cut_over_many_ranks() -> None:
    # 60 copies of one value straddle the cut: the search must narrow to one bit
    # pattern (a count > 1 never ends it), and drop the whole group.
    values = [0.01] * 20 + [0.07] * 60 + [1.0]
    parts = [f64(values[r::6]) for r in range(6)]
    cut = check_against_reference(parts, 0.04)[0]
    assert (cut.cutoff < 0.07, cut.kept) == (True, 20)


def test_wide_dynamic_range_and_few_terms() -> None:
    values = [5e-324, 1e-310, 1e-200, 1e-20, 0.03, 0.05, 1e100, 1e300]
    parts = [f64(values[:3]), f64(values[3:])]
    union = f64(values)
    for max_terms in (64, 128):
        cuts = m2po_cutoff_in_process(parts, 0.04, max_terms=max_terms)
        assert cuts[0].kept == m2po_cutoff_reference(union, 0.04)[1] == 6
        assert cuts[0].terms_sent <= max_terms * cuts[0].rounds


def test_edges_every_token_masked_and_empty_ranks() -> None:
    nothing = check_against_reference([f64([0.05, 0.3]), f64([]), f64([0.04])], 0.04)[0]
    assert (nothing.kept, nothing.total, nothing.cutoff) == (0, 3, -math.inf)
    assert not nothing.keep(f64([0.05, 0.0])).any()
    empty = check_against_reference([f64([]), f64([])], 0.04)[0]
    assert (empty.kept, empty.total, empty.rounds) == (0, 0, 1)
    everything = check_against_reference([f64([0.0]), f64([0.01, 0.02])], 0.04)[0]
    assert everything.kept == 3
    # keep() of a [B, T] batch of this rank: the inactive positions are never kept.
    some = check_against_reference([f64([0.0, 0.01]), f64([0.5, 0.02])], 0.04)[0]
    assert some.kept == 3
    mask = torch.tensor([[True, False], [True, True]])
    batch = torch.tensor([[0.01, 0.0], [0.5, 0.02]], dtype=torch.float64)
    assert some.keep(batch, mask).tolist() == [
        [True, False],
        [False, True],
    ]


def test_an_invalid_value_names_its_rank_position_and_value() -> None:
    with pytest.raises(InvalidPartialError, match=r"rank 0: m2 value nan at position 1 ") as err:
        m2po_cutoff_in_process([f64([0.0, math.nan]), f64([0.1])], 0.04)
    assert math.isnan(err.value.values[0])  # the value itself
    with pytest.raises(UsageError, match="m2_threshold=nan"):
        m2po_cutoff_in_process([f64([0.0])], math.nan)


def test_round_keys_and_bounds() -> None:
    assert m2po_round_step(3, 0) == 3 * M2PO_STEP_STRIDE
    with pytest.raises(UsageError, match="outside"):
        m2po_round_step(3, M2PO_STEP_STRIDE)
    # MAX_WORLD_SIZE limbs of LIMB_BITS bits, each + 1, sum exactly in float64.
    assert MAX_WORLD_SIZE * 2**LIMB_BITS <= 2**53
    with pytest.raises(UsageError, match="world_size=8193"):
        m2po_cutoff_in_process([f64([])] * (MAX_WORLD_SIZE + 1), 0.04)
    assert worst_case_rounds(8 * 10**6) < M2PO_STEP_STRIDE
    assert worst_case_rounds(8 * 10**6, 256) < worst_case_rounds(8 * 10**6)
    with pytest.raises(UsageError, match="max_terms=8 is too small"):
        worst_case_rounds(8 * 10**6, 8)
