"""A rank's shard of rollouts as the PPO mini-batch verl's ``train_mini_batch`` takes.

verl's trainer hands its actor a TensorDict in verl's no-padding layout (nested
tensors built from the attention mask by verl's ``left_right_2_no_padding``),
with the mini-batch size, epochs and micro-batch size as non-tensor fields.
Here one step is one mini-batch (one optimizer step) of ``rows`` rows on every
rank: verl's data-parallel collectives need every rank to run the same number
of micro-batches, so a shard with fewer rows is topped up with padding rows
whose response mask is all zero. lossreduce counts only active units, so a
padding row weighs 0 in every term and is counted in no normalizer.

Prompt groups travel as verl's ``uid`` (``prompt_mean`` reads it): the step's
group index for real rows, a group of its own for each padding row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from lossreduce.trainer_worker.train.rollouts import RolloutBatch
from lossreduce.trainer_worker.train.task import BOS, EOS

__all__ = ["mini_batch"]


def mini_batch(
    shard: RolloutBatch,
    group_ids: Sequence[int],
    *,
    rows: int,
    world_size: int,
    microbatches: int,
    temperature: float,
    rank: int,
) -> Any:
    """``shard`` (whole groups ``group_ids`` of the step), padded to ``rows`` rows, as
    verl's mini-batch TensorDict of ``microbatches`` micro-batches; ``rows * world_size``
    rows make the global mini-batch."""
    n, pad = len(shard), rows - len(shard)
    if pad < 0 or rows % microbatches or len(group_ids) != len(shard.group_sizes):
        raise ValueError(
            f"rank {rank}: a shard of {n} rows in {len(shard.group_sizes)} groups does not fit "
            f"{rows} rows in {microbatches} micro-batches with group ids {list(group_ids)}"
        )
    prompt_len = shard.prompt_len
    width = shard.tokens.shape[1]  # P + L
    length = width - prompt_len
    filler = torch.full((pad, width), EOS, dtype=torch.long)
    filler[:, 0] = BOS
    tokens = torch.cat([shard.tokens, filler])  # [rows, P + L]
    # Padding rows attend to everything (never an empty sequence) and train on nothing.
    loss_mask = torch.cat([shard.loss_mask, torch.zeros(pad, length)])  # [rows, L]
    attention = torch.cat([torch.ones(rows, prompt_len), loss_mask], dim=1).long()
    attention[n:] = 1
    zeros = torch.zeros(pad, length)
    advantages = torch.cat([shard.advantages, torch.zeros(pad)])  # [rows]
    uids = [
        f"group-{group_ids[g]}" for g, size in enumerate(shard.group_sizes) for _ in range(size)
    ]
    uids += [f"pad-{rank}-{i}" for i in range(pad)]
    td = TensorDict(
        {
            "input_ids": tokens,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "prompts": tokens[:, :prompt_len],
            "responses": tokens[:, prompt_len:],
            "response_mask": loss_mask.long(),
            "advantages": advantages[:, None].expand(rows, length).clone(),  # [rows, L]
            "old_log_probs": torch.cat([shard.old_logprobs, zeros]),
            "ref_log_prob": torch.cat([shard.ref_logprobs, zeros]),
            "uid": NonTensorStack(*uids),
        },
        batch_size=[rows],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        global_batch_size=rows * world_size,
        mini_batch_size=rows * world_size,
        epochs=1,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
        temperature=temperature,
        micro_batch_size_per_gpu=rows // microbatches,
    )
    return td
