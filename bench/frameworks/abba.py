"""What the framework benches' A/B pairs share: one ABBA order, its timing loop and the
small Qwen2 both sides load.

Each bench (:mod:`.verl`, :mod:`.skyrl`, :mod:`.trl`, :mod:`.areal`) times lossreduce's
side against the framework's own on the same workload and reports the ratio of their
medians. They take the order and the model from here (and, where they time call by call,
the warm-up and the loop) so that a ratio means the same for every framework: the same
drift-cancelling order, the same model shape built the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

__all__ = ["ABBA", "EOS", "PAD", "ModelSizes", "save_qwen2", "time_abba"]

ABBA: tuple[bool, bool, bool, bool] = (True, False, False, True)
"""One ABBA block, True for lossreduce's side: each side runs once early and once late in
the block, so a drift in the machine's speed (thermal, other load, caches) hits both alike
(in verl's bench, runs of several steps in a row measured up to 9% apart on a quiet
machine with identical work, whichever came first)."""

PAD, EOS = 0, 1
"""Token ids of padding and end of sequence, in :func:`save_qwen2`'s model and in the
batches the benches build for it."""


def time_abba(step: Callable[[bool], object], rounds: int) -> dict[bool, list[float]]:
    """Seconds of each timed ``step(lossreduce)`` call, by side: one untimed warm-up call
    of each side first (a first call builds caches, kernels, the optimizer's state), then
    ``rounds`` blocks of :data:`ABBA`, call by call."""
    for lossreduce in (True, False):
        step(lossreduce)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for lossreduce in ABBA:
            started = time.perf_counter()
            step(lossreduce)
            times[lossreduce].append(time.perf_counter() - started)
    return times


class ModelSizes(Protocol):
    """The model's sizes, as every bench's settings give them."""

    @property
    def vocab_size(self) -> int:
        """Vocabulary size."""
        ...

    @property
    def hidden_size(self) -> int:
        """Width of the model."""
        ...

    @property
    def layers(self) -> int:
        """Transformer layers."""
        ...


def save_qwen2(
    folder: Path,
    sizes: ModelSizes,
    *,
    max_positions: int,
    seed: int,
    bos_token_id: int | None = EOS,
) -> Path:
    """A small Qwen2 of ``sizes`` and random weights (drawn after
    ``torch.manual_seed(seed)``) saved to ``folder``, so that both sides load the same
    weights: 4 attention heads over 2 key-value heads, an MLP twice the width, untied
    embeddings, :data:`PAD` and :data:`EOS` (``bos_token_id`` None: no BOS set)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=2 * sizes.hidden_size,
        num_hidden_layers=sizes.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=bos_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder
