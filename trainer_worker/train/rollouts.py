"""Rollouts: sample several responses per prompt, score, filter, assemble.

Sampling runs on the workers (each on its slice of the step's prompts, with a
generator seeded from ``(seed, step, first prompt)`` so a rerun draws the same
tokens); scoring, filtering and advantages run on the driver, which sees whole
prompt groups.

The filter makes prompt groups ragged, as real pipelines do: identical
responses within a group are dropped (keep the first), and a group whose
remaining responses all scored the same is dropped (it carries no
group-relative signal — DAPO's dynamic sampling). When the policy has solved
every prompt of a step the whole step is filtered out: that is an *empty step*,
handled by ``--on-empty-step``.

Shared by every engine whose policy reads the task's token ids: a policy is
any module mapping ``[N, T]`` token ids to ``[N, T, V]`` logits over at least
the task's ``OUTPUT_VOCAB`` (:class:`~lossreduce.trainer_worker.train.hf_policy.TaskLogits`
adapts a Hugging Face causal LM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lossreduce.trainer_worker.train.task import EOS

__all__ = [
    "RolloutBatch",
    "Samples",
    "build_batch",
    "filter_groups",
    "group_advantages",
    "response_logprobs",
    "sample_responses",
    "shard_batch",
    "shard_groups",
]


@dataclass(frozen=True)
class Samples:
    """Responses sampled for consecutive prompts, ``samples_per_prompt`` each."""

    tokens: torch.Tensor
    """``[N, P + L]`` long: prompt then response (``EOS``-padded)."""
    loss_mask: torch.Tensor
    """``[N, L]`` float: 1 for generated tokens up to and including ``EOS``."""
    old_logprobs: torch.Tensor
    """``[N, L]`` float: log-probs under the sampling policy."""
    ref_logprobs: torch.Tensor
    """``[N, L]`` float: log-probs under the frozen reference policy."""

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        return Samples(
            tokens=torch.cat([p.tokens for p in parts]),
            loss_mask=torch.cat([p.loss_mask for p in parts]),
            old_logprobs=torch.cat([p.old_logprobs for p in parts]),
            ref_logprobs=torch.cat([p.ref_logprobs for p in parts]),
        )


@dataclass(frozen=True)
class RolloutBatch:
    """Filtered responses grouped by prompt, ready for the loss."""

    tokens: torch.Tensor
    """``[N, P + L]`` long."""
    loss_mask: torch.Tensor
    """``[N, L]`` float."""
    old_logprobs: torch.Tensor
    """``[N, L]`` float."""
    ref_logprobs: torch.Tensor
    """``[N, L]`` float."""
    advantages: torch.Tensor
    """``[N]`` float: group-relative advantage of each response."""
    group_sizes: tuple[int, ...]
    """Responses per prompt group, in row order; sums to ``N``."""
    prompt_len: int
    """``P``: tokens of prompt before each response."""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def group_tokens(self) -> list[int]:
        """Loss tokens per prompt group."""
        per_row = self.loss_mask.sum(dim=1).tolist()  # [N]
        out, start = [], 0
        for size in self.group_sizes:
            out.append(int(sum(per_row[start : start + size])))
            start += size
        return out

    def as_input(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The engine's batch: named tensors on ``device`` (see ``GRPOLoss``)."""
        return {
            "tokens": self.tokens.to(device),
            "loss_mask": self.loss_mask.to(device),
            "old_logprobs": self.old_logprobs.to(device),
            "ref_logprobs": self.ref_logprobs.to(device),
            "advantages": self.advantages.to(device),
            "group_sizes": torch.tensor(self.group_sizes, dtype=torch.long, device=device),
        }

    def select_groups(self, groups: Sequence[int]) -> RolloutBatch:
        """The sub-batch holding the given prompt groups, whole and in the given order."""
        offsets = [0]
        for size in self.group_sizes:
            offsets.append(offsets[-1] + size)
        rows = [r for g in groups for r in range(offsets[g], offsets[g + 1])]
        index = torch.tensor(rows, dtype=torch.long)
        return RolloutBatch(
            tokens=self.tokens[index],
            loss_mask=self.loss_mask[index],
            old_logprobs=self.old_logprobs[index],
            ref_logprobs=self.ref_logprobs[index],
            advantages=self.advantages[index],
            group_sizes=tuple(self.group_sizes[g] for g in groups),
            prompt_len=self.prompt_len,
        )


def group_advantages(
    rewards: torch.Tensor, group_sizes: Sequence[int], eps: float = 1e-6
) -> torch.Tensor:
    """``(r - mean_g) / (std_g + eps)`` within each prompt group (GRPO).

    ``rewards`` is ``[N]``, grouped by prompt with ``group_sizes`` summing to
    ``N``; the standard deviation is the population one, so a group of
    identical rewards gets advantage 0 everywhere.
    """
    if sum(group_sizes) != rewards.shape[0] or any(s < 1 for s in group_sizes):
        raise ValueError(
            f"group_sizes {list(group_sizes)} must be positive and sum to the "
            f"{rewards.shape[0]} rewards"
        )
    out = []
    for group in torch.split(rewards, list(group_sizes)):
        centred = group - group.mean()
        out.append(centred / (group.std(correction=0) + eps))
    return torch.cat(out) if out else rewards.new_zeros(0)


def response_logprobs(
    model: nn.Module, tokens: torch.Tensor, prompt_len: int, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of the response tokens under ``model``.

    ``tokens`` is ``[N, P + L]`` (prompt of ``P`` tokens, then the response);
    returns ``[N, L]``. Padding positions get finite values; callers mask them.
    """
    logits = model(tokens[:, :-1])[:, prompt_len - 1 :] / temperature  # [N, L, V]
    targets = tokens[:, prompt_len:]  # [N, L]
    # Input-only ids (BOS) never appear in a response; clamp keeps gather in range.
    targets = targets.clamp(max=logits.shape[-1] - 1)
    return torch.log_softmax(logits.float(), dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2)


@torch.no_grad()
def sample_responses(
    policy: nn.Module,
    reference: nn.Module | None,
    prompt_tokens: torch.Tensor,
    *,
    samples_per_prompt: int,
    response_len: int,
    temperature: float,
    generator: torch.Generator,
) -> Samples:
    """Sample ``samples_per_prompt`` responses for each of ``prompt_tokens`` ``[B, P]``.

    Rows come out grouped: the responses of prompt ``b`` are rows
    ``b * samples_per_prompt ... (b + 1) * samples_per_prompt - 1``.
    """
    device = prompt_tokens.device
    prompt_len = prompt_tokens.shape[1]
    seqs = prompt_tokens.repeat_interleave(samples_per_prompt, dim=0)  # [N, P]
    finished = torch.zeros(seqs.shape[0], dtype=torch.bool, device=device)  # [N]
    masks = []
    for _ in range(response_len):
        logits = policy(seqs)[:, -1].float() / temperature  # [N, V]
        # Sample on CPU with the seeded generator: identical draws on every device.
        drawn = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator)
        drawn = drawn.squeeze(1).to(device)  # [N]
        masks.append((~finished).float())
        drawn = torch.where(finished, torch.full_like(drawn, EOS), drawn)
        finished |= drawn == EOS
        seqs = torch.cat([seqs, drawn.unsqueeze(1)], dim=1)
    loss_mask = torch.stack(masks, dim=1)  # [N, L]
    old = response_logprobs(policy, seqs, prompt_len, temperature)  # [N, L]
    ref = (
        response_logprobs(reference, seqs, prompt_len, temperature)
        if reference is not None
        else torch.zeros_like(old)
    )
    return Samples(tokens=seqs, loss_mask=loss_mask, old_logprobs=old, ref_logprobs=ref)


def filter_groups(
    responses: torch.Tensor, rewards: torch.Tensor, samples_per_prompt: int
) -> tuple[list[int], list[int]]:
    """Rows to keep and the resulting group sizes.

    ``responses`` ``[N, L]`` and ``rewards`` ``[N]`` come grouped by prompt,
    ``samples_per_prompt`` rows each. Within a group, a response identical to
    an earlier one is dropped; then a group whose kept rewards are all equal
    (including a group of one) is dropped whole.
    """
    if responses.shape[0] % samples_per_prompt:
        raise ValueError(
            f"{responses.shape[0]} responses are not a multiple of "
            f"samples_per_prompt={samples_per_prompt}"
        )
    keep: list[int] = []
    sizes: list[int] = []
    rows = responses.tolist()
    scores = rewards.tolist()
    for start in range(0, len(rows), samples_per_prompt):
        seen: set[tuple[int, ...]] = set()
        group = []
        for row in range(start, start + samples_per_prompt):
            key = tuple(rows[row])
            if key not in seen:
                seen.add(key)
                group.append(row)
        if len({scores[r] for r in group}) > 1:
            keep.extend(group)
            sizes.append(len(group))
    return keep, sizes


def build_batch(
    samples: Samples, rewards: torch.Tensor, samples_per_prompt: int, prompt_len: int
) -> RolloutBatch:
    """Filter ``samples`` and attach group-relative advantages."""
    responses = samples.tokens[:, prompt_len:]
    keep, sizes = filter_groups(responses, rewards, samples_per_prompt)
    index = torch.tensor(keep, dtype=torch.long)
    kept_rewards = rewards[index]
    return RolloutBatch(
        tokens=samples.tokens[index],
        loss_mask=samples.loss_mask[index],
        old_logprobs=samples.old_logprobs[index],
        ref_logprobs=samples.ref_logprobs[index],
        advantages=group_advantages(kept_rewards, sizes),
        group_sizes=tuple(sizes),
        prompt_len=prompt_len,
    )


def shard_groups(group_tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign whole prompt groups to ``world_size`` ranks, balancing tokens.

    Greedy longest-first onto the least-loaded rank (ties: lowest rank, then
    lowest group index), so the assignment is deterministic. Each rank's
    groups come back in ascending order; a rank may get none.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    order = sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g))
    for group in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(group)
        loads[rank] += group_tokens[group]
    return [sorted(shard) for shard in shards]


def shard_batch(batch: RolloutBatch, world_size: int) -> list[RolloutBatch]:
    """Each rank's shard of ``batch``: whole prompt groups, balancing tokens
    (:func:`shard_groups`)."""
    return [
        batch.select_groups(groups) for groups in shard_groups(batch.group_tokens(), world_size)
    ]
