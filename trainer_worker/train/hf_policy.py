"""A Hugging Face causal LM over the built-in task's token ids, for engines that train one.

verl and AReaL load their policy from a Hugging Face checkpoint folder, so the
built-in policy of such an engine is a tiny Qwen2 built from its config over the
task's ids (:mod:`lossreduce.trainer_worker.train.task`: digits, ``EOS``, ``BOS``),
seeded and saved where every rank of the node can load it. No tokenizer is
involved: prompts and responses are token ids throughout.

Imports transformers (every framework extra brings it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from lossreduce.trainer_worker.train.task import BOS, EOS, INPUT_VOCAB, OUTPUT_VOCAB, stream_seed
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["TaskLogits", "save_task_qwen2", "task_qwen2_config"]


def task_qwen2_config(settings: TrainSettings) -> Qwen2Config:
    """The built-in policy's shape: ``--d-model``, ``--layers``, ``--heads`` over the task's ids."""
    return Qwen2Config(
        vocab_size=INPUT_VOCAB,
        hidden_size=settings.d_model,
        intermediate_size=2 * settings.d_model,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.heads,
        max_position_embeddings=1 + settings.prompt_len + settings.response_len + 8,
        tie_word_embeddings=False,
        # EOS pads a finished response; BOS opens every prompt.
        pad_token_id=EOS,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )


def save_task_qwen2(settings: TrainSettings, folder: Path) -> Path:
    """The built-in policy, seeded from ``--seed``, saved to ``folder`` (returned).

    The same settings give the same weights in every process, so a rank on a node
    without the driver's disk rebuilds it instead of copying it.
    """
    torch.manual_seed(stream_seed(settings.seed, "init"))
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the run prints its own progress
    try:
        Qwen2ForCausalLM(task_qwen2_config(settings)).save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return folder


class TaskLogits(nn.Module):
    """A causal LM as the rollout sampler's policy: ``[N, T]`` ids -> ``[N, T, OUTPUT_VOCAB]``
    logits (``BOS`` is input-only, so it is never sampled)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits  # [N, T, V]
        return logits[..., :OUTPUT_VOCAB]
