"""A toy problem and an independent reference for the reduction tests.

Data: prompt groups of responses; every token has features ``x`` [F] and an
advantage. A linear model maps features to three per-token channels, giving
three token losses (policy gradient, distillation, entropy).

The reference computes the global loss straight from the formulas of
``docs/reduction-semantics.md`` with Python loops over responses and
groups, in float64, calling the model only on tokens whose loss counts. It
shares no code with the library: the tests compare the two.

Masked-out tokens (``loss_mask == 0``) hold NaN features and advantages, so any
leak of a masked value into a loss or a gradient shows up as NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lossreduce.trainer_worker import (
    LossReduction,
    LossTerm,
    PolicyGradientReduction,
    zero_masked,
)

FEATURES = 3
GARBAGE = float("nan")


@dataclass(frozen=True)
class Seq:
    """One response: features [L, F], advantages [L], numerator and denominator masks."""

    x: Tensor
    adv: Tensor
    m: tuple[bool, ...]
    d: tuple[bool, ...]


Group = list[Seq]


@dataclass(frozen=True)
class TermSpec:
    """One loss term of a test: its name, mode, divisor, model channel and kind."""

    name: str
    mode: str
    channel: int
    kind: str = "mean"
    divisor: float | None = None


def make_groups(
    seed: int,
    group_sizes: Sequence[int],
    *,
    max_len: int = 5,
    p_keep: float = 0.7,
    p_reject: float = 0.2,
) -> list[Group]:
    """Random groups: lengths 1..max_len, ``d`` kept with p_keep, ``m`` = ``d`` minus rejections."""
    gen = torch.Generator().manual_seed(seed)
    groups: list[Group] = []
    for size in group_sizes:
        group = []
        for _ in range(size):
            length = int(torch.randint(1, max_len + 1, (1,), generator=gen))
            d = torch.rand(length, generator=gen, dtype=torch.float64) < p_keep
            m = d & (torch.rand(length, generator=gen, dtype=torch.float64) >= p_reject)
            x = torch.randn(length, FEATURES, generator=gen, dtype=torch.float64)
            adv = torch.randn(length, generator=gen, dtype=torch.float64)
            x[~m] = GARBAGE
            adv[~m] = GARBAGE
            group.append(Seq(x, adv, tuple(bool(v) for v in m), tuple(bool(v) for v in d)))
        groups.append(group)
    return groups


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(FEATURES, 3, dtype=torch.float64)


def channel_loss(channel: int, out: Tensor, adv: Tensor) -> Tensor:
    """Per-token loss of a channel from the model output of that channel."""
    if channel == 0:
        return out * adv  # policy gradient: advantage-weighted
    if channel == 1:
        return (out - 0.5) ** 2  # distillation-like penalty
    return torch.tanh(out)  # entropy-like bonus


# ---------------------------------------------------------------- library side


def build_batch(groups: Sequence[Group], *, packed: bool) -> dict[str, Tensor]:
    """The library's input: padded [B, T] or packed [total_tokens] + cu_seqlens.

    No groups give an empty microbatch: padded [0, 1], or packed with cu_seqlens [0].
    """
    seqs = [s for g in groups for s in g]
    sizes = torch.tensor([len(g) for g in groups], dtype=torch.long)
    if packed:
        lengths = [len(s.m) for s in seqs]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return {
            "x": torch.cat([s.x for s in seqs] or [torch.zeros(0, FEATURES, dtype=torch.float64)]),
            "advantages": torch.cat([s.adv for s in seqs] or [torch.zeros(0, dtype=torch.float64)]),
            "loss_mask": torch.tensor([v for s in seqs for v in s.m], dtype=torch.bool),
            "denominator_mask": torch.tensor([v for s in seqs for v in s.d], dtype=torch.bool),
            "cu_seqlens": cu,
            "group_sizes": sizes,
        }
    width = max((len(s.m) for s in seqs), default=1)
    x = torch.full((len(seqs), width, FEATURES), GARBAGE, dtype=torch.float64)
    adv = torch.full((len(seqs), width), GARBAGE, dtype=torch.float64)
    m = torch.zeros(len(seqs), width, dtype=torch.bool)
    d = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s.m)
        x[i, :n], adv[i, :n] = s.x, s.adv
        m[i, :n], d[i, :n] = torch.tensor(s.m), torch.tensor(s.d)
    return {
        "x": x,
        "advantages": adv,
        "loss_mask": m,
        "denominator_mask": d,
        "group_sizes": sizes,
    }


def forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Mask the inputs before the model: a NaN feature must not reach a gradient."""
    mask = batch["loss_mask"].bool().unsqueeze(-1)
    x = torch.where(mask, batch["x"], torch.zeros((), dtype=batch["x"].dtype))
    out: Tensor = model(x)
    return out  # [B, T, 3] or [total_tokens, 3]


def make_reduction(specs: Sequence[TermSpec]) -> LossReduction:
    reductions = {s.name: PolicyGradientReduction(s.mode, s.divisor) for s in specs}

    def loss_fn(out: Tensor, mb: Mapping[str, Tensor]) -> dict[str, Tensor]:
        mask = mb["loss_mask"]
        adv = zero_masked(mb["advantages"], mask)
        return {
            s.name: reductions[s.name].aggregate(
                channel_loss(s.channel, out[..., s.channel], adv),
                mask,
                denominator_mask=mb["denominator_mask"],
                cu_seqlens=mb.get("cu_seqlens"),
                group_sizes=mb["group_sizes"],
                local_mean=s.kind == "mean",
            )
            for s in specs
        }

    terms: list[LossTerm] = [
        reductions[s.name].term(s.name, "mean" if s.kind == "mean" else "sum") for s in specs
    ]
    return LossReduction(loss_fn, terms)


# ---------------------------------------------------------------- reference


def _numerator(model: nn.Module, seq: Seq, channel: int) -> Tensor:
    keep = [t for t, v in enumerate(seq.m) if v]
    if not keep:
        return torch.zeros((), dtype=torch.float64)
    out = model(seq.x[keep])[:, channel]
    return channel_loss(channel, out, seq.adv[keep]).sum()


def reference_normalizer(groups: Sequence[Group], spec: TermSpec) -> float:
    seqs = [s for g in groups for s in g]
    if spec.mode == "token_mean":
        return float(sum(sum(s.d) for s in seqs))
    if spec.mode == "prompt_mean":
        return float(sum(1 for g in groups if any(any(s.d) for s in g)))
    return float(sum(1 for s in seqs if any(s.d)))


def reference_term(model: nn.Module, groups: Sequence[Group], spec: TermSpec) -> Tensor:
    """The term's global value from the formula table (mean and sum terms agree)."""
    n = reference_normalizer(groups, spec)
    if n == 0:
        raise ZeroDivisionError(f"term {spec.name!r}: no active unit in the whole batch")
    total = torch.zeros((), dtype=torch.float64)
    if spec.mode in ("token_mean", "constant"):
        for g in groups:
            for s in g:
                total = total + _numerator(model, s, spec.channel)
        if spec.mode == "constant":
            assert spec.divisor is not None
            total = total / spec.divisor
    elif spec.mode == "seq_mean":
        for g in groups:
            for s in g:
                if any(s.d):
                    total = total + _numerator(model, s, spec.channel) / sum(s.d)
    else:
        for g in groups:
            den = sum(sum(s.d) for s in g)
            if den:
                total = (
                    total
                    + sum((_numerator(model, s, spec.channel) for s in g), torch.zeros(())) / den
                )
    return total / n


def reference_loss_and_grads(
    model: nn.Module, groups: Sequence[Group], specs: Sequence[TermSpec]
) -> tuple[float, list[Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = sum(
        (reference_term(model, groups, s) for s in specs), torch.zeros((), dtype=torch.float64)
    )
    if loss.requires_grad:  # no counted token anywhere: the loss is a constant 0
        loss.backward()
    grads = [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def grads_of(model: nn.Module) -> list[Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]


THREE_TERMS = (
    TermSpec("pg", "prompt_mean", channel=0),
    TermSpec("distill", "token_mean", channel=1),
    TermSpec("entropy", "seq_mean", channel=2),
)
