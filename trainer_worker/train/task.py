"""The built-in synthetic task: continue a digit sequence by a hidden rule.

Each prompt shows the first ``prompt_len`` terms of an arithmetic progression
modulo 10 (``a, a+d, a+2d, ...`` with a hidden step ``d``); the policy must
continue it for ``response_len`` digits and may stop early with ``EOS``. The
reward is rule-based and dense — the fraction of the ``response_len`` expected
digits it got right, position by position — so a tiny transformer trained from
scratch with GRPO gets signal from its first random samples (one digit in ten
is right by chance) and visibly improves within minutes on a CPU.

Token ids: digits ``0..9`` are themselves, ``EOS`` = 10 ends a response (and
pads it after the end), ``BOS`` = 11 opens every prompt. The policy predicts
only digits and ``EOS`` (``OUTPUT_VOCAB`` = 11); ``BOS`` is input-only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

__all__ = [
    "BOS",
    "EOS",
    "INPUT_VOCAB",
    "OUTPUT_VOCAB",
    "DigitTask",
    "Prompts",
    "stream_seed",
]

EOS = 10
"""Ends a response; positions after it are padding and carry no loss."""
BOS = 11
"""Opens every prompt."""
OUTPUT_VOCAB = 11
"""Tokens the policy can emit: the ten digits and ``EOS``."""
INPUT_VOCAB = 12
"""Tokens the policy can read: its outputs and ``BOS``."""


def stream_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit seed for one random stream, e.g. ``("sample", step, first_prompt)``.

    Hashing keeps streams independent and identical in every process.
    """
    text = "/".join([str(seed), purpose, *map(str, keys)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class Prompts:
    """A batch of prompts and the continuations the hidden rule expects."""

    tokens: torch.Tensor
    """``[B, 1 + prompt_len]`` long: ``BOS`` then the shown digits."""
    targets: torch.Tensor
    """``[B, response_len]`` long: the digits a perfect response writes."""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class DigitTask:
    """Arithmetic progressions modulo 10 with a hidden step in ``1..max_step``."""

    prompt_len: int = 3
    """Digits shown in each prompt (at least 2, so the step is visible)."""
    response_len: int = 4
    """Digits a response must write; it is also the longest response."""
    max_step: int = 3
    """The hidden step ``d`` is drawn uniformly from ``1..max_step``."""

    def __post_init__(self) -> None:
        if self.prompt_len < 2:
            raise ValueError(f"prompt_len={self.prompt_len} must be >= 2 to reveal the step")
        if self.response_len < 1:
            raise ValueError(f"response_len={self.response_len} must be >= 1")
        if not 1 <= self.max_step <= 9:
            raise ValueError(f"max_step={self.max_step} must be in 1..9")

    def sample_prompts(self, count: int, generator: torch.Generator) -> Prompts:
        """``count`` prompts drawn with ``generator`` (deterministic per seed)."""
        start = torch.randint(0, 10, (count, 1), generator=generator)  # [B, 1]
        step = torch.randint(1, self.max_step + 1, (count, 1), generator=generator)  # [B, 1]
        index = torch.arange(self.prompt_len + self.response_len).unsqueeze(0)  # [1, P+L]
        digits = (start + step * index) % 10  # [B, P+L]
        bos = torch.full((count, 1), BOS, dtype=torch.long)
        tokens = torch.cat([bos, digits[:, : self.prompt_len]], dim=1)  # [B, 1+P]
        return Prompts(tokens=tokens, targets=digits[:, self.prompt_len :].contiguous())

    def score(self, responses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Fraction of expected digits written correctly, per response.

        ``responses`` is ``[N, L]`` (``EOS``-padded after an early stop) and
        ``targets`` ``[N, response_len]``; the result is ``[N]`` float in [0, 1].
        """
        if responses.shape != targets.shape or responses.shape[1] != self.response_len:
            raise ValueError(
                f"responses {tuple(responses.shape)} and targets {tuple(targets.shape)} "
                f"must both be [N, response_len={self.response_len}]"
            )
        # An EOS never equals a digit, so an early stop scores the rest as wrong.
        return (responses == targets).float().mean(dim=1)
