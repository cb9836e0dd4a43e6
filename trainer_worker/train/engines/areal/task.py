"""The digit task's rollouts as AReaL's PPO actor takes them (pure torch, no AReaL import).

AReaL's ``ppo_update`` takes a list of trajectory dicts, one per rollout
episode (here: one per prompt group, which the LossReduce actor numbers as
its own group), each a padded batch of ``[n, T]`` tensors over whole
sequences (prompt, then response):

- ``input_ids``: the tokens; ``attention_mask``: 1 up to the response's end
  (its ``EOS``, or its last token when it ran to ``--response-len``);
- ``loss_mask``: 1 at the response tokens that carry loss (AReaL's
  ``compute_advantages`` rolls it by one, so that position ``t`` predicts
  token ``t + 1``);
- ``rewards``: ``[n]``, each response's group-relative advantage (GRPO),
  placed by ``compute_advantages`` on the response's last token, so that with
  ``discount = gae_lambda = 1`` every token of the response gets it (plus
  the KL-in-reward penalty after it, when ``--kl-coef`` > 0);
- ``ref_logp`` (with ``--kl-coef`` > 0): the frozen reference's
  log-probabilities, already aligned as AReaL's are (position ``t`` holds
  token ``t + 1``'s).

The behaviour log-probabilities are recomputed by AReaL's own
``compute_logp`` on the training engine (``recompute_logprob``), so the PPO
ratio is exactly the training engine's.
"""

from __future__ import annotations

import torch

from lossreduce.trainer_worker.train.rollouts import RolloutBatch
from lossreduce.trainer_worker.train.task import BOS, EOS

__all__ = ["Trajectory", "placeholder_group", "trajectories"]

Trajectory = dict[str, torch.Tensor]
"""One prompt group as AReaL's ``ppo_update`` takes it."""


def trajectories(batch: RolloutBatch, *, with_reference: bool) -> list[Trajectory]:
    """``batch``'s prompt groups, one trajectory dict each, in row order."""
    prompt_len = batch.prompt_len
    rows, width = batch.tokens.shape  # [N, P + L]
    lengths = prompt_len + batch.loss_mask.sum(dim=1).long()  # [N]: up to and with EOS
    position = torch.arange(width)[None, :]  # [1, T]
    attention = position < lengths[:, None]  # [N, T]
    loss_mask = torch.zeros(rows, width)
    loss_mask[:, prompt_len:] = batch.loss_mask
    out: list[Trajectory] = []
    start = 0
    for size in batch.group_sizes:
        rows_of = slice(start, start + size)
        item: Trajectory = {
            "input_ids": batch.tokens[rows_of],
            "attention_mask": attention[rows_of],
            "loss_mask": loss_mask[rows_of],
            "rewards": batch.advantages[rows_of].float(),
        }
        if with_reference:
            ref = torch.zeros(size, width)
            # Position t holds token t + 1's log-probability, as AReaL's compute_logp.
            ref[:, prompt_len - 1 : width - 1] = batch.ref_logprobs[rows_of]
            item["ref_logp"] = ref
        out.append(item)
        start += size
    return out


def placeholder_group(
    prompt_len: int, width: int, rows: int, *, with_reference: bool
) -> Trajectory:
    """``rows`` responses without a loss token, for a rank with fewer rows than micro-batches.

    AReaL cuts a rank's batch into exactly ``n_mbs`` micro-batches and needs a
    row for each, and every rank of its FSDP group must run as many forwards
    (their parameter all-gathers are collective). Rows without a loss token
    are no active unit in any mode: they add 0 to every partial, and a rank
    with nothing to train still takes part in the step's round
    (docs/reduction-semantics.md).
    """
    tokens = torch.full((rows, width), EOS, dtype=torch.long)
    tokens[:, 0] = BOS
    item: Trajectory = {
        "input_ids": tokens,
        "attention_mask": (torch.arange(width)[None, :] < prompt_len).expand(rows, width),
        "loss_mask": torch.zeros(rows, width),
        "rewards": torch.zeros(rows),
    }
    if with_reference:
        item["ref_logp"] = torch.zeros(rows, width)
    return item
