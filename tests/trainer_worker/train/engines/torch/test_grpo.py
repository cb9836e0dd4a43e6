"""GRPO pieces: advantages, the PPO-clipped loss, the KL penalty, sharding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.trainer_worker.train.engines.torch.grpo import (
    kl_penalty,
    ppo_clip_loss,
)
from lossreduce.trainer_worker.train.rollouts import group_advantages, shard_groups

group_sizes_st = st.lists(st.integers(1, 6), min_size=1, max_size=8)


@settings(max_examples=50, deadline=None)
@given(sizes=group_sizes_st, data=st.data())
def test_advantages_are_standardized_within_each_group(
    sizes: list[int], data: st.DataObject
) -> None:
    rewards = torch.tensor(
        data.draw(
            st.lists(
                st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
                min_size=sum(sizes),
                max_size=sum(sizes),
            )
        ),
        dtype=torch.float64,
    )
    adv = group_advantages(rewards, sizes)
    assert adv.shape == rewards.shape
    for r, a in zip(torch.split(rewards, sizes), torch.split(adv, sizes), strict=True):
        assert abs(float(a.sum())) < 1e-9
        if float(r.std(correction=0)) > 0:
            # Population std of (r - mean) / (std + eps) is 1 up to eps.
            assert abs(float(a.std(correction=0)) - 1.0) < 1e-4
            # Higher reward, higher advantage.
            assert torch.equal(torch.argsort(r, stable=True), torch.argsort(a, stable=True))
        else:
            assert bool((a == 0).all())


def test_advantages_reject_sizes_that_do_not_tile() -> None:
    with pytest.raises(ValueError, match=r"sum to the 3 rewards"):
        group_advantages(torch.zeros(3), [2, 2])


def test_ppo_loss_at_ratio_one_is_minus_advantage_with_policy_gradient() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25]], requires_grad=False)).requires_grad_()
    loss = ppo_clip_loss(logp, logp.detach(), torch.tensor([2.0]), clip_eps=0.2)
    assert torch.allclose(loss, torch.tensor([[-2.0, -2.0]]))
    loss.sum().backward()
    assert logp.grad is not None
    # d(-ratio * A)/d logp = -A at ratio 1.
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, -2.0]]))


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "has_grad"),
    [
        (1.5, 1.0, -1.2, False),  # positive advantage: clipped above 1 + eps, no push further
        (1.1, 1.0, -1.1, True),  # inside the clip range
        (0.5, -1.0, 0.8, False),  # negative advantage: clipped below 1 - eps
        (0.5, 1.0, -0.5, True),  # pessimistic min keeps the unclipped term
    ],
)
def test_ppo_clipping(ratio: float, advantage: float, expected_loss: float, has_grad: bool) -> None:
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), torch.log(torch.tensor(ratio)).item(), requires_grad=True)
    loss = ppo_clip_loss(logp, old, torch.tensor([advantage]), clip_eps=0.2)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    loss.sum().backward()
    assert logp.grad is not None
    assert (logp.grad.abs().item() > 0) == has_grad


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-5, 0), min_size=1, max_size=10),
    st.lists(st.floats(-5, 0), min_size=1, max_size=10),
)
def test_kl_penalty_is_non_negative_and_zero_on_equal_policies(
    a: list[float], b: list[float]
) -> None:
    n = min(len(a), len(b))
    logp = torch.tensor([a[:n]], dtype=torch.float64)
    ref = torch.tensor([b[:n]], dtype=torch.float64)
    assert bool((kl_penalty(logp, ref) >= -1e-12).all())
    assert bool((kl_penalty(logp, logp) == 0).all())


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 40), min_size=0, max_size=30), world=st.integers(1, 8))
def test_sharding_keeps_every_group_whole_once_and_balances(tokens: list[int], world: int) -> None:
    shards = shard_groups(tokens, world)
    assert len(shards) == world
    flat = [g for shard in shards for g in shard]
    # Every group index lands on exactly one rank (a group is never split).
    assert sorted(flat) == list(range(len(tokens)))
    assert all(shard == sorted(shard) for shard in shards)
    loads = [sum(tokens[g] for g in shard) for shard in shards]
    # Greedy longest-first: no rank exceeds the lightest by more than the biggest group.
    assert max(loads) - min(loads) <= max(tokens, default=0)
    assert shard_groups(tokens, world) == shards  # deterministic


def test_sharding_rejects_empty_world() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        shard_groups([1, 2], 0)
