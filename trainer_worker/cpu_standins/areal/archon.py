"""AReaL's Archon engine on a machine without CUDA: the two settings it needs.

AReaL 1.0.4's ``ArchonEngine`` already has a CPU branch (CPU device, gloo
groups, FSDP2 on a CPU mesh), but two of its defaults cannot run there. Both
are AReaL's own options, so nothing of AReaL is patched:

1. Attention. ``actor.archon.attn_type: varlen`` (the default) calls
   ``torch.ops.aten._flash_attention_forward``, which has no CPU kernel
   (``NotImplementedError: Could not run 'aten::_flash_attention_forward' with
   arguments from the 'CPU' backend``). ``sdpa`` is Archon's block-causal
   scaled-dot-product attention over the same packed ``cu_seqlens``, and runs
   on CPU.
2. Padding (the rope). Unless ``actor.pad_to_maximum``, Archon pads every
   packed micro-batch to a whole 2 MiB page of activations:
   ``2 MiB / (hidden_size * dtype bytes)`` tokens, 32,768 for a width-16 float32
   model. The padding tokens get positions up to that length, past the rope
   cache of a model with fewer ``max_position_embeddings`` (``IndexError: index
   64 is out of bounds for dimension 0 with size 64`` in Archon's
   ``rope.reshape_for_broadcast``), and the SDPA mask would be that length
   squared. ``pad_to_maximum`` pads each micro-batch to
   ``mb_spec.max_tokens_per_mb`` instead; the padding is its own packed
   sequence and is cut from the log-probabilities before the loss. Its
   positions count from 0 up to that budget, so the budget must stay within
   the model's ``max_position_embeddings``, and there must be one: with AReaL's
   default ``MicroBatchSpec()`` (``max_tokens_per_mb=None``) AReaL drops
   ``pad_to_maximum`` with a warning and pads to the page again (the same
   ``IndexError`` in the rope). :func:`archon_cpu_config` refuses both.

A GPU run needs neither; both are valid there too. This module does not import
AReaL.
"""

from __future__ import annotations

from typing import Any

from lossreduce.errors import ReductionConfigError

__all__ = ["ARCHON_CPU_OVERRIDES", "archon_cpu_config"]

ARCHON_CPU_OVERRIDES = ("++actor.archon.attn_type=sdpa", "++actor.pad_to_maximum=true")
"""The same two settings as command-line overrides of an AReaL launch (Hydra's ``++``:
set the key whether or not the experiment's YAML has it)."""


def archon_cpu_config(config: Any) -> Any:
    """Set ``config`` (an AReaL ``PPOActorConfig`` or any ``TrainEngineConfig``) to run
    the Archon engine on CPU, as the module docstring explains; returns it.

    Raises ReductionConfigError, leaving ``config`` as it was, when
    ``mb_spec.max_tokens_per_mb`` is None (AReaL would then pad to a whole page) or
    above the model's ``max_position_embeddings`` (read from ``config.path``): either
    way the padding's positions would run past Archon's rope cache.
    """
    from transformers import AutoConfig

    budget = config.mb_spec.max_tokens_per_mb
    positions = getattr(AutoConfig.from_pretrained(config.path), "max_position_embeddings", None)
    fix = (
        f"to at most the model's max_position_embeddings={positions}"
        if positions is not None
        else "to the most tokens one packed micro-batch may hold"
    )
    if budget is None:
        raise ReductionConfigError(
            f"mb_spec.max_tokens_per_mb=None ({config.path}): Archon on CPU pads each "
            "micro-batch to that token budget (pad_to_maximum), and without one AReaL "
            "drops pad_to_maximum and pads to a whole 2 MiB page of activations, whose "
            "positions run past the rope cache; set mb_spec.max_tokens_per_mb "
            f"(actor.mb_spec.max_tokens_per_mb in a launch) {fix}"
        )
    if positions is not None and budget > positions:
        raise ReductionConfigError(
            f"mb_spec.max_tokens_per_mb={budget} is above the model's "
            f"max_position_embeddings={positions} ({config.path}): with pad_to_maximum "
            "Archon pads a micro-batch to that many tokens, and the padding's positions "
            "would run past its rope cache; lower max_tokens_per_mb"
        )
    config.archon.attn_type = "sdpa"
    config.pad_to_maximum = True
    return config
