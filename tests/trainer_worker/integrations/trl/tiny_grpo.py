"""A tiny offline GRPO setup for the TRL tests, and its independent reference.

No hub access: a word-level tokenizer built with ``tokenizers``, a 1-layer
``Qwen2`` saved to a temporary folder (TRL loads the reference model from
that path), three prompts of three tokens each (equal lengths: no left padding,
so positions match across micro-batches), and a fixed ``rollout_func`` whose
completions depend only on the prompt and the completion's index in its group:
uneven lengths, some ending in EOS, some truncated.

:func:`reference_update` recomputes one optimizer step's SGD update from the
formulas of the reduction semantics, row by row, without TRL or the code
under test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS = 0, 1
WORDS = ["<pad>", "<eos>", *(chr(c) for c in range(ord("a"), ord("z") + 1))]
PROMPTS = ["a b c", "d e f", "g h i"]
NUM_GENERATIONS = 4
MAX_COMPLETION = 6
# prompt index -> completion of each generation; no EOS at the end = truncated.
COMPLETIONS: dict[int, list[list[int]]] = {
    0: [[5, 6, 1], [7, 1], [8, 9, 10, 11, 12, 13], [2, 1]],
    1: [[3, 4, 5, 1], [9, 9, 9, 9, 9, 9], [4, 1], [5, 5, 6, 7, 1]],
    2: [[6, 1], [10, 11, 12, 13, 14, 15], [7, 7, 1], [12, 3, 4, 5, 6, 1]],
}
# Every completion truncated: with mask_truncated_completions nothing is active.
TRUNCATED: dict[int, list[list[int]]] = {
    p: [[2 + p + g, 3, 4, 5, 6, 7] for g in range(NUM_GENERATIONS)] for p in range(len(PROMPTS))
}
# The same prompts answered with each completion one token shorter (truncated ones
# stay truncated): a second half whose token counts differ from the first's.
SHORTER: dict[int, list[list[int]]] = {
    p: [c[1:] if c[-1] == EOS and len(c) > 2 else c for c in gens]
    for p, gens in COMPLETIONS.items()
}
# Each TRL loss type's own division of its policy loss as a lossreduce (mode, divisor),
# read off TRL 1.16's _compute_loss: dapo, cispo and vespo divide by the step's tokens,
# bnpo by the micro-step's; grpo and sapo each completion by its tokens, then by
# completions; dr_grpo by max_completion_length x completions; luspo sums each
# completion's tokens and averages over completions.
OWN_DIVISION: dict[str, tuple[str, float | None]] = {
    "dapo": ("token_mean", None),
    "grpo": ("seq_mean", None),
    "dr_grpo": ("constant", float(MAX_COMPLETION)),
    "bnpo": ("token_mean", None),
    "cispo": ("token_mean", None),
    "sapo": ("seq_mean", None),
    "luspo": ("constant", 1.0),
    "vespo": ("token_mean", None),
}
REF_NOISE = 0.2
"""The reference model is the initial model plus this much seeded noise, so the
KL term has a gradient at the first step."""


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def save_model(folder: Path) -> Path:
    """A tiny Qwen2 with seeded weights, saved to ``folder``; returns the folder."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS})


def prompt_index(prompt: str) -> int:
    return PROMPTS.index(prompt)


def prompt_ids(prompt: str) -> list[int]:
    return [WORDS.index(w) for w in prompt.split()]


@dataclass
class Rollout:
    """A ``rollout_func``: fixed completions; ``table`` is switched to make empty steps, or
    steps with other token counts, and the processes in ``truncated_processes`` answer
    every prompt with truncated (masked) completions."""

    table: dict[int, list[list[int]]] = field(default_factory=lambda: COMPLETIONS)
    empty_from_step: int | None = None
    shorter_from_step: int | None = None
    truncated_processes: tuple[int, ...] = ()

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        table = self.table
        step = trainer.state.global_step
        if self.shorter_from_step is not None and step >= self.shorter_from_step:
            table = SHORTER
        if self.empty_from_step is not None and step >= self.empty_from_step:
            table = TRUNCATED
        if trainer.accelerator.process_index in self.truncated_processes:
            table = TRUNCATED
        # TRL's groups are consecutive rows of the batch gathered in process order.
        first = trainer.accelerator.process_index * len(prompts)
        completions = [
            table[prompt_index(p)][(first + i) % NUM_GENERATIONS] for i, p in enumerate(prompts)
        ]
        return {
            "prompt_ids": [prompt_ids(p) for p in prompts],
            "completion_ids": completions,
            "logprobs": None,
        }


def reward(completion: Sequence[int]) -> float:
    return float(sum(completion) % 7) + 0.5 * len(completion)


def reward_func(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any
) -> list[float]:
    return [reward(c) for c in completion_ids]


def perturb(model: torch.nn.Module) -> None:
    """Add the seeded reference-model noise, the same in every process."""
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(REF_NOISE * torch.randn(param.shape, generator=generator).to(param))


# -- the independent reference -------------------------------------------------------


@dataclass(frozen=True)
class Row:
    prompt: int
    generation: int

    @property
    def completion(self) -> list[int]:
        return COMPLETIONS[self.prompt][self.generation]

    @property
    def truncated(self) -> bool:
        return self.completion[-1] != EOS


def all_rows() -> list[Row]:
    return [Row(p, g) for p in range(len(PROMPTS)) for g in range(NUM_GENERATIONS)]


def advantage(row: Row) -> float:
    """reward - mean reward of its group (scale_rewards='none')."""
    rewards = [reward(c) for c in COMPLETIONS[row.prompt]]
    return reward(row.completion) - sum(rewards) / len(rewards)


def row_weights(
    rows: Sequence[Row], tokens: dict[Row, int], mode: str, divisor: float | None
) -> tuple[dict[Row, float], float]:
    """(w_i per row, N) of the policy term, straight from the mode definitions."""
    active = [r for r in rows if tokens[r] > 0]
    if mode == "token_mean":
        return dict.fromkeys(active, 1.0), float(sum(tokens[r] for r in active))
    if mode == "seq_mean":
        return {r: 1.0 / tokens[r] for r in active}, float(len(active))
    if mode == "constant":
        assert divisor is not None
        return dict.fromkeys(active, 1.0 / divisor), float(len(active))
    groups = {r.prompt for r in active}
    group_tokens = {g: sum(tokens[r] for r in active if r.prompt == g) for g in groups}
    return {r: 1.0 / group_tokens[r.prompt] for r in active}, float(len(groups))


def _forward(model: torch.nn.Module, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [C], entropies [C]) of the row's completion tokens, unpadded."""
    prompt = prompt_ids(PROMPTS[row.prompt])
    ids = torch.tensor([prompt + row.completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [C, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, torch.tensor(row.completion)[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def reference_update(
    model_dir: Path,
    rows: Sequence[Row],
    *,
    mode: str,
    divisor: float | None,
    lr: float,
    beta: float,
    entropy_coef: float,
    mask_truncated: bool,
) -> dict[str, torch.Tensor]:
    """Parameter -> its SGD update for one on-policy step over ``rows``.

    loss = sum_i w_i sum_t -A_i * ratio_it / N_pg + beta * sum kl * ratio / N_tok
    - coef * sum H / N_tok (ratio = exp(logp - logp.detach()): 1, with the
    policy gradient's derivative).
    """
    model = Qwen2ForCausalLM.from_pretrained(model_dir).float()
    model.eval()
    ref = Qwen2ForCausalLM.from_pretrained(model_dir).float()
    perturb(ref)
    ref.eval()
    tokens = {r: 0 if (mask_truncated and r.truncated) else len(r.completion) for r in rows}
    weights, n_pg = row_weights(rows, tokens, mode, divisor)
    n_tok = float(sum(tokens.values()))
    loss = torch.zeros((), dtype=torch.float64)
    for row in rows:
        if tokens[row] == 0:
            continue
        logp, entropy = _forward(model, row)
        ratio = torch.exp(logp - logp.detach())
        loss = loss + weights[row] * (-advantage(row) * ratio).sum().double() / n_pg
        if beta:
            with torch.no_grad():
                ref_logp, _ = _forward(ref, row)
            diff = ref_logp - logp
            # TRL's default use_bias_correction_kl multiplies the KL by the ratio.
            kl = (torch.exp(diff) - diff - 1) * ratio
            loss = loss + beta * kl.sum().double() / n_tok
        if entropy_coef:
            loss = loss - entropy_coef * entropy.sum().double() / n_tok
    loss.backward()
    return {
        name: -lr * p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| over all parameters / max |want|."""
    scale = max(float(w.abs().max()) for w in want.values())
    diff = max(float((got[n] - want[n]).abs().max()) for n in want)
    return diff / scale if scale > 0 else math.inf
