"""The AReaL tests' attention (:mod:`.areal_runs`): transformers' ``sdpa`` replaced by one
that masks per packed sequence from the ``cu_seq_lens_q`` AReaL passes (what flash-attn's
varlen kernel does on a GPU), so a micro-batch may hold several sequences without
attention leaking between them."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

__all__ = ["use_varlen_attention", "varlen_sdpa"]


def varlen_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence of ``cu_seq_lens_q``."""
    length = query.shape[2]  # query [1, H, S, D], key/value [1, H_kv, S, D]
    positions = torch.arange(length, device=query.device)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        segment = torch.zeros_like(positions)
    else:
        segment = torch.bucketize(positions, cu[1:].to(query.device, torch.int64), right=True)
    mask = (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])
    repeat = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(repeat, dim=1)
    value = value.repeat_interleave(repeat, dim=1)
    out = functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_varlen_attention() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = varlen_sdpa
