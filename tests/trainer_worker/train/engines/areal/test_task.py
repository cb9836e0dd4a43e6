"""The digit task's rollouts as AReaL's trajectory dicts: masks, rewards and reference aligned
the way AReaL's ``compute_advantages`` and ``compute_logp`` read them."""

from __future__ import annotations

import torch

from lossreduce.trainer_worker.train.engines.areal.task import placeholder_group, trajectories
from lossreduce.trainer_worker.train.rollouts import RolloutBatch
from lossreduce.trainer_worker.train.task import BOS, EOS

PROMPT = 3  # BOS and two digits
RESPONSE = 3


def _batch() -> RolloutBatch:
    """Three responses in groups of 2 and 1: lengths 3 (no EOS), 2 (EOS) and 1 (EOS)."""
    tokens = torch.tensor(
        [
            [BOS, 1, 2, 3, 4, 5],
            [BOS, 1, 2, 3, EOS, EOS],
            [BOS, 7, 8, EOS, EOS, EOS],
        ]
    )
    loss_mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ref = torch.arange(9, dtype=torch.float32).reshape(3, 3) - 10.0
    return RolloutBatch(
        tokens=tokens,
        loss_mask=loss_mask,
        old_logprobs=torch.zeros(3, 3),
        ref_logprobs=ref,
        advantages=torch.tensor([1.0, -1.0, 0.5]),
        group_sizes=(2, 1),
        prompt_len=PROMPT,
    )


def test_each_prompt_group_is_one_trajectory_dict_over_whole_sequences() -> None:
    first, second = trajectories(_batch(), with_reference=True)
    assert first["input_ids"].shape == (2, PROMPT + RESPONSE)
    assert second["input_ids"].shape == (1, PROMPT + RESPONSE)
    # Attention up to and with the EOS; the loss on the response's tokens (AReaL rolls it).
    assert first["attention_mask"].tolist() == [[True] * 6, [True] * 5 + [False]]
    assert second["attention_mask"].tolist() == [[True] * 4 + [False] * 2]
    assert first["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0]]
    assert first["rewards"].tolist() == [1.0, -1.0]
    assert second["rewards"].tolist() == [0.5]
    # Position t holds token t + 1's reference log-probability, as AReaL's compute_logp.
    assert first["ref_logp"][0].tolist() == [0, 0, -10, -9, -8, 0]
    assert second["ref_logp"][0, PROMPT - 1].item() == -4.0


def test_without_a_kl_term_no_reference_travels() -> None:
    assert all("ref_logp" not in g for g in trajectories(_batch(), with_reference=False))


def test_placeholder_rows_have_no_loss_token() -> None:
    group = placeholder_group(PROMPT, PROMPT + RESPONSE, 2, with_reference=True)
    assert group["input_ids"][:, 0].tolist() == [BOS, BOS]
    assert group["attention_mask"].sum(-1).tolist() == [PROMPT, PROMPT]
    assert not group["loss_mask"].any()
    assert group["rewards"].tolist() == [0.0, 0.0]
    assert group["ref_logp"].shape == (2, PROMPT + RESPONSE)
