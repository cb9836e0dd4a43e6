"""A small causal transformer policy (pre-norm GPT blocks, learned positions).

Deliberately minimal — the point of the job is the distributed reduction, not
the model — but a real policy: causal self-attention through
``scaled_dot_product_attention``, a GELU MLP, tied nothing, and an output
head over the task's ``OUTPUT_VOCAB``.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional

__all__ = ["CausalTransformer", "PolicyConfig"]


class PolicyConfig(BaseModel):
    """Shape of the policy network."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input_vocab: int = Field(default=12, ge=2, description="Number of token ids the policy reads.")
    output_vocab: int = Field(
        default=11, ge=2, description="Number of token ids the policy can emit."
    )
    max_len: int = Field(default=16, ge=2, description="Longest prompt + response, in tokens.")
    d_model: int = Field(default=64, ge=8, description="Width of the residual stream.")
    n_heads: int = Field(
        default=4, ge=1, description="Attention heads per layer (must divide d_model)."
    )
    n_layers: int = Field(default=2, ge=1, description="Number of transformer blocks.")


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape  # [B, T, D]
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)  # 3 x [B, T, D]
        heads = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D/H]
        attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class CausalTransformer(nn.Module):
    """``forward(tokens [B, T]) -> logits [B, T, output_vocab]``; position t
    predicts token t + 1."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(
                f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}"
            )
        self.config = config
        self.tok = nn.Embedding(config.input_vocab, config.d_model)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(
            _Block(config.d_model, config.n_heads) for _ in range(config.n_layers)
        )
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.output_vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds max_len={self.config.max_len}")
        positions = torch.arange(length, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))  # [B, T, V]
        return logits
