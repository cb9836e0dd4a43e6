"""The built-in digit task as text, for ``lossreduce train --engine trl``.

TRL trains on text prompts and scores text completions, so the task of
:mod:`lossreduce.trainer_worker.train.task` is rendered as words: a prompt is
its shown digits separated by spaces (``"3 5 7"``), and the reward reads the
digits of a completion in order and scores them with
:meth:`DigitTask.score` (the fraction of expected digits right, position by
position; a missing digit is wrong). The default policy is a tiny Qwen2 built
from its config with a word-level tokenizer over the ten digits.

Imports transformers and datasets (``pip install 'lossreduce[trl]'``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from lossreduce.trainer_worker.train.task import EOS, DigitTask, stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = [
    "WORDS",
    "DigitReward",
    "digit_tokenizer",
    "parse_digits",
    "prompt_dataset",
    "save_tiny_qwen2",
    "task_of",
]

WORDS = ["<pad>", "<eos>", *(str(d) for d in range(10))]
"""Vocabulary of the built-in tokenizer: pad, EOS, then the digits."""

_DIGIT = re.compile(r"\d")


def task_of(settings: TrainSettings) -> DigitTask:
    return DigitTask(settings.prompt_len, settings.response_len, settings.max_step)


def digit_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` (pad 0, EOS 1)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def save_tiny_qwen2(settings: TrainSettings, folder: Path) -> Path:
    """The default policy, seeded, saved with its tokenizer to ``folder``.

    TRL loads the KL reference model from the policy's path, so the policy
    lives on disk even though it is built in code.
    """
    torch.manual_seed(stream_seed(settings.seed, "init"))
    config = Qwen2Config(
        vocab_size=len(WORDS),
        hidden_size=settings.d_model,
        intermediate_size=2 * settings.d_model,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.heads,
        max_position_embeddings=settings.prompt_len + settings.response_len + 8,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the run prints its own progress
    try:
        Qwen2ForCausalLM(config).save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    digit_tokenizer().save_pretrained(folder)
    return folder


def prompt_dataset(settings: TrainSettings, count: int) -> Dataset:
    """``count`` prompts (``"3 5 7"``) with their expected continuations (``"9 1 3 5"``)."""
    prompts = task_of(settings).sample_prompts(
        count, torch.Generator().manual_seed(stream_seed(settings.seed, "prompts"))
    )
    digits = prompts.tokens[:, 1:]  # [B, prompt_len]: the BOS is not rendered
    return Dataset.from_dict(
        {
            "prompt": [" ".join(map(str, row.tolist())) for row in digits],
            "target": [" ".join(map(str, row.tolist())) for row in prompts.targets],
        }
    )


def parse_digits(text: str, length: int) -> list[int]:
    """The first ``length`` digits of ``text`` in order, padded with EOS (never right)."""
    digits = [int(d) for d in _DIGIT.findall(text)[:length]]
    return digits + [EOS] * (length - len(digits))


class DigitReward:
    """TRL reward function: :meth:`DigitTask.score` of each completion's digits."""

    __name__ = "digits"  # TRL names the reward's metrics after it

    def __init__(self, task: DigitTask) -> None:
        self.task = task

    def __call__(self, completions: Sequence[str], target: Sequence[str], **_: Any) -> list[float]:
        length = self.task.response_len
        responses = torch.tensor([parse_digits(text, length) for text in completions])  # [N, L]
        targets = torch.tensor([parse_digits(text, length) for text in target])  # [N, L]
        return [float(r) for r in self.task.score(responses, targets)]
