"""The synthetic digit task and its rule-based reward."""

from __future__ import annotations

import itertools

import pytest
import torch

from lossreduce.trainer_worker.train.task import BOS, EOS, DigitTask


def test_prompts_follow_a_progression_modulo_10() -> None:
    task = DigitTask(prompt_len=3, response_len=4, max_step=3)
    prompts = task.sample_prompts(50, torch.Generator().manual_seed(0))
    assert prompts.tokens.shape == (50, 4)
    assert prompts.targets.shape == (50, 4)
    assert bool((prompts.tokens[:, 0] == BOS).all())
    for row, target in zip(prompts.tokens.tolist(), prompts.targets.tolist(), strict=True):
        digits = row[1:] + target
        step = (digits[1] - digits[0]) % 10
        assert 1 <= step <= 3
        assert all((b - a) % 10 == step for a, b in itertools.pairwise(digits))


def test_prompts_are_deterministic_per_seed() -> None:
    task = DigitTask()
    a = task.sample_prompts(8, torch.Generator().manual_seed(7))
    b = task.sample_prompts(8, torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.targets, b.targets)


def test_reward_counts_correct_positions_and_early_stop_scores_zero_after_it() -> None:
    task = DigitTask(response_len=4)
    targets = torch.tensor([[4, 6, 8, 0]] * 4)
    responses = torch.tensor(
        [
            [4, 6, 8, 0],  # perfect
            [4, 6, 1, 0],  # three right
            [4, EOS, EOS, EOS],  # stopped early after one right
            [1, 2, 3, 5],  # none
        ]
    )
    assert task.score(responses, targets).tolist() == [1.0, 0.75, 0.25, 0.0]


def test_score_rejects_mismatched_shapes() -> None:
    task = DigitTask(response_len=4)
    with pytest.raises(ValueError, match=r"response_len=4"):
        task.score(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_len": 1}, "prompt_len=1"),
        ({"response_len": 0}, "response_len=0"),
        ({"max_step": 10}, "max_step=10"),
    ],
)
def test_bad_task_settings_name_the_field(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DigitTask(**kwargs)
