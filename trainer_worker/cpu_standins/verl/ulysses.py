"""verl's Ulysses sequence parallelism on CPU: the attention it wraps, and its all-to-all over gloo.

verl's FSDP engine with ``ulysses_sequence_parallel_size > 1`` (and
``use_remove_padding=True``, which Ulysses needs) meets two pieces that only a GPU has;
:func:`install` gives each a CPU stand-in in this process, changing no installed file:

1. **Attention.** verl wraps transformers' flash-attention path
   (``transformers.integrations.flash_attention._flash_attention_forward``) with its
   all-to-alls (sequence shards in, head shards out), then calls transformers' own
   ``_flash_attention_forward``, which needs the CUDA ``flash_attn`` kernels. The
   stand-in is :func:`varlen_attention`, causal attention within each packed sequence
   (a sequence starts where its ``position_ids`` restart at 0, as flash-attention's
   varlen path reads them), under the attention name :data:`ATTENTION`
   (``override_config.attn_implementation=cpu_varlen``), which routes a model through
   transformers' flash-attention entry point, the one verl patches.
2. **The all-to-all.** gloo has ``all_to_all_single`` but not ``all_to_all``
   (``RuntimeError: Backend gloo does not support alltoall``), which verl's
   ``all_to_all_tensor`` calls with equal chunks: :func:`gloo_all_to_all_tensor` moves
   the same chunks with one ``all_to_all_single``.

For CPU runs and tests only; a GPU run has flash-attention and NCCL.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import verl.models.transformers.monkey_patch as verl_monkey_patch
import verl.utils.ulysses as verl_ulysses
from torch import Tensor
from torch.nn import functional
from transformers.integrations import flash_attention
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["ATTENTION", "gloo_all_to_all_tensor", "install", "varlen_attention"]

ATTENTION = "cpu_varlen"
"""The attention implementation to name in ``override_config.attn_implementation``."""


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    query_length: int,
    *_: Any,
    position_ids: Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = True,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **__: Any,
) -> Tensor:
    """Causal attention within each packed sequence, in flash-attention's layout:
    ``query`` ``[b, s, h, d]``, ``key``/``value`` ``[b, s, hk, d]`` (``h`` a multiple of
    ``hk``), ``position_ids`` ``[b, s]``; returns ``[b, s, h, d]``. Keyword options
    transformers' flash-attention call passes and this does not implement are refused."""
    unsupported = {
        "attention_mask": attention_mask is not None,
        "is_causal=False": not is_causal,
        "dropout": dropout != 0.0,
        "sliding_window": sliding_window is not None,
        "softcap": softcap is not None,
        "no position_ids": position_ids is None,
    }
    if any(unsupported.values()):
        used = [name for name, on in unsupported.items() if on]
        raise NotImplementedError(f"the CPU varlen attention does not implement {used}")
    assert position_ids is not None
    length, heads, head_dim = query.shape[1:]  # [b, s, h, d]
    assert length == query_length, (length, query_length)
    segment = (position_ids == 0).cumsum(-1)  # [b, s]: which packed sequence
    positions = torch.arange(length, device=query.device)
    allowed = (segment[:, :, None] == segment[:, None, :]) & (
        positions[:, None] >= positions[None, :]
    )  # [b, s, s]
    repeat = heads // key.shape[2]
    key = key.repeat_interleave(repeat, dim=2)  # [b, s, h, d]
    value = value.repeat_interleave(repeat, dim=2)
    out = functional.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim),
    )  # [b, h, s, d]
    return out.transpose(1, 2)


def gloo_all_to_all_tensor(
    local_input: Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Tensor:
    """verl's ``all_to_all_tensor`` through ``all_to_all_single``: chunk ``i`` of
    ``scatter_dim`` goes to rank ``i``, what rank ``i`` sent arrives as chunk ``i`` of
    ``gather_dim`` (synchronous: gloo's work is done when the call returns)."""
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in torch.tensor_split(local_input, world, scatter_dim)]
    sizes = {c.shape for c in chunks}
    if len(sizes) != 1:
        raise ValueError(f"all_to_all over gloo needs equal chunks, got shapes {sorted(sizes)}")
    sent = torch.stack(chunks)  # [world, *chunk]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    out = torch.cat(list(received.unbind(0)), dim=gather_dim)
    if async_op:
        return lambda: out  # type: ignore[return-value]
    return out


def install() -> None:
    """Register :data:`ATTENTION` and route verl's Ulysses attention and all-to-all to
    their CPU stand-ins in this process (idempotent)."""
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, flash_attention.flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, flash_attention_mask)
    verl_monkey_patch._flash_attention_forward = varlen_attention
    verl_ulysses.all_to_all_tensor = gloo_all_to_all_tensor
