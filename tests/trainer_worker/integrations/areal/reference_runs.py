"""The reference of the AReaL tests: each mode's SGD update from
docs/reduction-semantics.md, row by row, in plain PyTorch on the same initial weights
(no AReaL, no code under test), over the data of :mod:`.areal_runs`."""

from __future__ import annotations

from typing import Any

import torch

from tests.trainer_worker.integrations.areal.areal_runs import (
    DIVISOR,
    EPS_CLIP,
    GROUP_SIZES,
    LR,
    MODES,
    group_rows,
)

__all__ = ["formula_updates", "reference_updates"]


def reference_updates(
    model_dir: str, initial: dict[str, torch.Tensor]
) -> dict[str, dict[str, Any]]:
    """Each mode's SGD update from docs/reduction-semantics.md, row by row, in plain
    PyTorch on the same initial weights (no AReaL, no code under test)."""
    rows = [group_rows(g) for g in range(len(GROUP_SIZES))]
    return formula_updates(model_dir, initial, rows, [r["loss_mask"].bool() for r in rows])


def formula_updates(
    model_dir: str,
    initial: dict[str, torch.Tensor],
    rows: list[dict[str, torch.Tensor]],
    masks: list[torch.Tensor],
) -> dict[str, dict[str, Any]]:
    """Each mode's SGD update of AReaL's PPO loss (ratio to ``prox_logp``) over the
    tokens of ``masks`` (one [b, T] bool mask per group of ``rows``), in plain PyTorch:
    the formulas of docs/reduction-semantics.md, a response without a token inactive."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(initial)
    out = {}
    for mode in MODES:
        model.zero_grad()
        per_group = []
        for g, group in enumerate(rows):
            per_row = []
            for i in range(GROUP_SIZES[g]):
                length = int(group["attention_mask"][i].sum())
                ids = group["input_ids"][i : i + 1, :length]
                logits = model(input_ids=ids).logits[0].float()  # [L, V]
                logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
                m = masks[g][i, : length - 1]
                adv = group["advantages"][i, : length - 1]
                ratio = torch.exp(logp - group["prox_logp"][i, : length - 1])
                clipped = ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP)
                token_loss = torch.maximum(-adv * ratio, -adv * clipped)
                per_row.append((torch.where(m, token_loss, 0.0).sum(), float(m.sum())))
            per_group.append(per_row)
        flat = [r for grp in per_group for r in grp]
        total: Any
        if mode == "token_mean":
            total = sum(s for s, _ in flat) / sum(d for _, d in flat)
        elif mode == "seq_mean":
            active = [(s, d) for s, d in flat if d > 0]
            total = sum(s / d for s, d in active) / len(active)
        elif mode == "constant":
            active = [(s, d) for s, d in flat if d > 0]
            total = sum(s for s, _ in active) / (DIVISOR * len(active))
        else:
            groups = [grp for grp in per_group if sum(d for _, d in grp) > 0]
            total = sum(sum(s for s, _ in grp) / sum(d for _, d in grp) for grp in groups) / len(
                groups
            )
        total.backward()
        out[mode] = {
            "loss": float(total.detach()),
            "params": {n: (p - LR * p.grad).detach().clone() for n, p in model.named_parameters()},
        }
    return out
