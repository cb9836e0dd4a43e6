"""The M2PO reference of the AReaL tests: the mask a decision over the whole step keeps
(:func:`global_m2po_keep`) and each mode's update over those tokens, in plain Python and
PyTorch, independent of the code under test. The M2PO data itself is
:func:`.areal_runs.m2po_prox`'s."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from tests.trainer_worker.integrations.areal.areal_runs import GROUP_SIZES, group_rows
from tests.trainer_worker.integrations.areal.reference_runs import formula_updates

__all__ = ["global_m2po_keep", "m2po_reference_updates"]


def global_m2po_keep(rows: list[dict[str, torch.Tensor]], threshold: float) -> list[torch.Tensor]:
    """Each group's [b, T] mask of the active tokens a mask decided over the whole step keeps.

    Plain Python, independent of the code under test: every active token's
    ``m2 = (old - prox)^2`` in float64; the tokens kept are those with ``m2 <= c`` for the largest value
    ``c`` of the step whose tokens ``m2 <= c`` have a mean below ``threshold``
    (compared exactly, in fractions), none when no value qualifies. Without ties
    this is AReaL's rule: drop the largest until the mean of the rest is below
    the threshold.
    """
    m2 = []
    for group in rows:
        delta = group["logprobs"].double() - group["prox_logp"].double()  # [b, T]
        m2.append(torch.where(group["loss_mask"] != 0, delta * delta, math.nan))
    values = sorted(float(v) for g in m2 for v in g[~g.isnan()].tolist())
    limit = Fraction(threshold)
    cut = -math.inf
    total = Fraction(0)
    for n, value in enumerate(values, start=1):
        total += Fraction(value)
        # Admissible only once every equal value is in (ties go together).
        if (n == len(values) or values[n] != value) and total < limit * n:
            cut = value
    return [(g <= cut) & ~g.isnan() for g in m2]


def m2po_reference_updates(
    model_dir: str, initial: dict[str, torch.Tensor], threshold: float, data: str = "m2po"
) -> dict[str, Any]:
    """Each mode's SGD update over the tokens :func:`global_m2po_keep` keeps, with
    AReaL's decoupled PPO loss (ratio to ``prox_logp``, no rejection sampling), in
    plain PyTorch: the formulas of docs/reduction-semantics.md with ``D_i`` the
    response's kept tokens and responses with none kept inactive."""
    rows = [group_rows(g, data) for g in range(len(GROUP_SIZES))]
    keep = global_m2po_keep(rows, threshold)
    out: dict[str, Any] = {"kept": [int(k.sum()) for k in keep]}
    out.update(formula_updates(model_dir, initial, rows, keep))
    return out
