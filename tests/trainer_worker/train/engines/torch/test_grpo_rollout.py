"""Rollouts: sampling, the group filter, batches and their sub-batches."""

from __future__ import annotations

import torch

from lossreduce.trainer_worker.train.engines.torch.model import CausalTransformer, PolicyConfig
from lossreduce.trainer_worker.train.rollouts import (
    Samples,
    build_batch,
    filter_groups,
    sample_responses,
)
from lossreduce.trainer_worker.train.task import EOS, DigitTask


def test_filter_drops_duplicates_and_groups_without_signal() -> None:
    responses = torch.tensor(
        [
            # group 0: a duplicate of row 0 is dropped -> size 2
            [1, 2],
            [1, 2],
            [3, 4],
            # group 1: all distinct but same reward -> dropped
            [5, 6],
            [7, 8],
            [9, 0],
            # group 2: all kept
            [1, 1],
            [2, 2],
            [3, 3],
        ]
    )
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.5, 1.0])
    keep, sizes = filter_groups(responses, rewards, samples_per_prompt=3)
    assert keep == [0, 2, 6, 7, 8]
    assert sizes == [2, 3]


def test_sampling_is_seeded_and_masks_after_eos() -> None:
    torch.manual_seed(0)
    model = CausalTransformer(PolicyConfig(d_model=16, n_heads=2, n_layers=1))
    task = DigitTask()
    prompts = task.sample_prompts(6, torch.Generator().manual_seed(1))

    def draw() -> torch.Tensor:
        s = sample_responses(
            model,
            None,
            prompts.tokens,
            samples_per_prompt=4,
            response_len=task.response_len,
            temperature=1.0,
            generator=torch.Generator().manual_seed(3),
        )
        responses = s.tokens[:, prompts.tokens.shape[1] :]
        for row, mask in zip(responses.tolist(), s.loss_mask.tolist(), strict=True):
            if EOS in row:
                end = row.index(EOS)
                assert all(t == EOS for t in row[end:])
                assert mask == [1.0] * (end + 1) + [0.0] * (len(row) - end - 1)
            else:
                assert mask == [1.0] * len(row)
        assert bool((s.old_logprobs <= 0).all())
        return s.tokens

    assert torch.equal(draw(), draw())


def test_batch_select_groups_keeps_groups_whole() -> None:
    n, length = 9, 3
    responses = [
        [1, 1, 1],
        [2, 2, 2],
        [3, 3, 3],
        [4, 4, 4],
        [4, 4, 4],
        [5, 5, 5],
        [6, 6, 6],
        [7, 7, 7],
        [8, 8, 8],
    ]
    samples_tokens = torch.cat([torch.full((n, 2), 11), torch.tensor(responses)], dim=1)

    samples = Samples(
        tokens=samples_tokens,
        loss_mask=torch.ones(n, length),
        old_logprobs=torch.zeros(n, length),
        ref_logprobs=torch.zeros(n, length),
    )
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    batch = build_batch(samples, rewards, samples_per_prompt=3, prompt_len=2)
    assert batch.group_sizes == (3, 2, 3)  # group 1 lost a duplicate row
    assert batch.group_tokens() == [9, 6, 9]
    sub = batch.select_groups([2, 0])
    assert sub.group_sizes == (3, 3)
    assert torch.equal(sub.tokens, torch.cat([batch.tokens[5:8], batch.tokens[0:3]]))
    assert torch.equal(sub.advantages, torch.cat([batch.advantages[5:8], batch.advantages[0:3]]))


def test_training_logprobs_match_sampling_logprobs_at_any_temperature() -> None:
    """The PPO ratio of the unchanged policy is 1: the loss's forward takes the
    log-probs at the temperature ``old_logprobs`` were sampled at."""
    from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
    from lossreduce.trainer_worker.train.engines.torch.grpo import GRPOLoss

    torch.manual_seed(0)
    model = CausalTransformer(PolicyConfig(d_model=16, n_heads=2, n_layers=1)).eval()
    task = DigitTask()
    prompts = task.sample_prompts(4, torch.Generator().manual_seed(1))
    for temperature in (0.5, 1.0, 2.0):
        s = sample_responses(
            model,
            model,
            prompts.tokens,
            samples_per_prompt=4,
            response_len=task.response_len,
            temperature=temperature,
            generator=torch.Generator().manual_seed(3),
        )
        loss = GRPOLoss(
            PolicyGradientMode("token_mean"),
            divisor=None,
            kl_coef=0.1,
            clip_eps=0.2,
            prompt_len=prompts.tokens.shape[1],
            temperature=temperature,
        )
        with torch.no_grad():
            logprobs = loss.forward(model, {"tokens": s.tokens})
        mask = s.loss_mask.bool()
        torch.testing.assert_close(logprobs[mask], s.old_logprobs[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(logprobs[mask], s.ref_logprobs[mask], rtol=0, atol=1e-5)
