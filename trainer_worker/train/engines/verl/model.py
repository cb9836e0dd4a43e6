"""The rollout policy of ``--engine verl``: the actor's own distribution, every logit.

verl's actor computes each response token's log-probability with a softmax over
the model's whole vocabulary, the task's ``BOS`` included. The rollouts must
be drawn from, and their ``old_log_probs`` and reference log-probabilities
computed under, that same distribution: then the PPO ratio of the one update
per batch starts at exactly 1 and the KL to the reference at exactly 0. (The
shared :class:`~lossreduce.trainer_worker.train.hf_policy.TaskLogits` drops
``BOS`` from the softmax, which would put every ratio off by the probability of
``BOS``.) A sampled ``BOS`` is just a wrong digit: the reward counts it wrong.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FullVocabLogits"]


class FullVocabLogits(nn.Module):
    """A causal LM as the rollout sampler's policy: ``[N, T]`` ids -> ``[N, T, V]`` logits
    over its whole vocabulary."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits  # [N, T, V]
        return logits
