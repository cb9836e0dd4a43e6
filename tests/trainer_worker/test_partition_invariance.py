"""Partition invariance: any split into ranks and microbatches gives the reference.

Random data (token losses from a small model, masks, denominator masks,
lengths, variable group sizes) is split into 1-8 simulated ranks and, per rank,
into random microbatches of whole prompt groups, some ranks with an extra
microbatch that holds no sequence at all. Each rank computes its
partials; their exact sum is the global normalizer; each rank scales and
backpropagates its microbatches into one shared model, which sums the
gradients of all ranks like an ``all_reduce(SUM)``. Total loss and gradients
must equal the independent reference of ``toy.py`` (float64, 1e-12).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.errors import EmptyNormalizerError
from lossreduce.trainer_worker import (
    LocalNormalizer,
    MicrobatchSettings,
    local_partials,
    scaled_loss,
    split_microbatches,
)
from lossreduce.trainer_worker.reduction import LossReduction
from tests.trainer_worker.toy import (
    THREE_TERMS,
    Group,
    TermSpec,
    build_batch,
    forward,
    grads_of,
    make_groups,
    make_model,
    make_reduction,
    reference_loss_and_grads,
)

Partition = tuple[list[Group], list[list[list[Group]]], bool, list[int]]


@st.composite
def partitions(draw: st.DrawFn) -> Partition:
    """(all groups, per rank a list of microbatches of groups, packed layout?, per rank
    where an empty microbatch goes among its microbatches: -1 for none)."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=7))
    groups = make_groups(
        draw(st.integers(0, 2**31)), sizes, p_keep=draw(st.sampled_from([0.3, 0.8, 1.0]))
    )
    world = draw(st.integers(1, 8))
    rank_of = draw(st.lists(st.integers(0, world - 1), min_size=len(groups), max_size=len(groups)))
    mb_of = draw(st.lists(st.integers(0, 3), min_size=len(groups), max_size=len(groups)))
    ranks: list[list[list[Group]]] = []
    for r in range(world):
        mbs = [
            [g for i, g in enumerate(groups) if rank_of[i] == r and mb_of[i] == b] for b in range(4)
        ]
        ranks.append([mb for mb in mbs if mb])
    empty_at = draw(st.lists(st.integers(-1, 4), min_size=world, max_size=world))
    return groups, ranks, draw(st.booleans()), empty_at


def simulate(
    reduction: LossReduction,
    ranks: list[list[list[Group]]],
    packed: bool,
    empty_at: list[int],
    use_splitter: bool,
) -> tuple[float, list[torch.Tensor]]:
    """Run every simulated rank through the library; return total loss and summed grads."""
    model = make_model()
    microbatches: list[list[dict[str, torch.Tensor]]] = []
    for rank_mbs, where in zip(ranks, empty_at, strict=True):
        if use_splitter:
            groups = [g for mb in rank_mbs for g in mb]
            batch = build_batch(groups, packed=packed)
            split = split_microbatches(batch, MicrobatchSettings(n_microbatches=3))
        else:
            split = [build_batch(mb, packed=packed) for mb in rank_mbs]
        if where >= 0:
            split.insert(where, build_batch([], packed=packed))
        microbatches.append(split)
    locals_ = [local_partials(reduction, mbs) for mbs in microbatches]
    summed = {
        name: torch.stack([lp.partials[name] for lp in locals_]).sum() for name in reduction.names
    }
    normalizers = LocalNormalizer().reduce(0, summed, reduction.contracts)
    total = 0.0
    for mbs, lp in zip(microbatches, locals_, strict=True):
        for mb, n_local in zip(mbs, lp.per_microbatch, strict=True):
            loss, _ = scaled_loss(
                reduction, reduction.losses(forward(model, mb), mb), n_local, normalizers
            )
            loss.backward()
            total += float(loss.detach())
    return total, grads_of(model)


def check(specs: tuple[TermSpec, ...], data: Partition, use_splitter: bool) -> None:
    groups, ranks, packed, empty_at = data
    reduction = make_reduction(specs)
    try:
        expected_loss, expected_grads = reference_loss_and_grads(make_model(), groups, specs)
    except ZeroDivisionError:
        with pytest.raises(EmptyNormalizerError):
            simulate(reduction, ranks, packed, empty_at, use_splitter)
        return
    loss, grads = simulate(reduction, ranks, packed, empty_at, use_splitter)
    torch.testing.assert_close(
        torch.tensor(loss), torch.tensor(expected_loss), rtol=1e-12, atol=1e-12
    )
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


MODES = [
    TermSpec("pg", "token_mean", channel=0),
    TermSpec("pg", "seq_mean", channel=0),
    TermSpec("pg", "prompt_mean", channel=0),
    TermSpec("pg", "constant", channel=0, divisor=7.0),
]


@pytest.mark.parametrize("kind", ["mean", "sum"])
@pytest.mark.parametrize("spec", MODES, ids=lambda s: s.mode)
@settings(max_examples=20, deadline=None)
@given(data=partitions(), use_splitter=st.booleans())
def test_single_term_is_partition_invariant(
    spec: TermSpec, kind: str, data, use_splitter: bool
) -> None:
    check((TermSpec(spec.name, spec.mode, spec.channel, kind, spec.divisor),), data, use_splitter)


@settings(max_examples=40, deadline=None)
@given(
    data=partitions(),
    use_splitter=st.booleans(),
    kinds=st.lists(st.sampled_from(["mean", "sum"]), min_size=3, max_size=3),
)
def test_three_terms_are_partition_invariant(data, use_splitter: bool, kinds: list[str]) -> None:
    specs = tuple(
        TermSpec(s.name, s.mode, s.channel, k, s.divisor)
        for s, k in zip(THREE_TERMS, kinds, strict=True)
    )
    check(specs, data, use_splitter)
