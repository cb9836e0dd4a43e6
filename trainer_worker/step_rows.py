"""Per-completion weights and per-process partials for steps whose prompt groups are split.

TRL deals the completions of one prompt group to different processes and
shuffles them into different micro-steps, so the library's microbatch
reductions (which need whole groups) do not apply directly. Here every
completion row of a generation batch, from every process, is known (a
gathered :class:`StepRows`), and the policy-gradient term of one optimizer
step ("window") is written as a sum over rows:

    loss = (sum over rows i of the window of w_i * sum_t l[i,t] * m[i,t]) / N

with, per mode (``D_i`` = tokens of row i under the loss mask, ``D_g`` = tokens
of prompt group g within the window, over all processes):

- ``token_mean``: ``w_i = 1``, ``N`` = tokens;
- ``seq_mean``: ``w_i = 1 / D_i``, ``N`` = active rows;
- ``prompt_mean``: ``w_i = 1 / D_g``, ``N`` = active groups (each counted once,
  by the lowest process holding an active row of it);
- ``constant``: ``w_i = 1 / C``, ``N`` = active rows.

That is the formula of docs/reduction-semantics.md over the window's rows,
however they are split. Pure torch: no TRL, gRPC or process group here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["RowPlan", "StepRows", "TermPlan", "bad_inputs", "group_ids", "plan_rows", "plan_terms"]


@dataclass(frozen=True)
class StepRows:
    """Every completion row of one generation batch on every process, process-major."""

    process: Tensor  # [R] int64: the process holding the row
    window: Tensor  # [R] int64: optimizer step within the generation batch
    group: Tensor  # [R] int64: prompt group, numbered over the whole generation batch
    tokens: Tensor  # [R] float64: D_i, tokens of the row under the loss mask


@dataclass(frozen=True)
class RowPlan:
    """What one process needs: its rows' weights and its partial normalizers per window."""

    weights: Tensor  # [R_local] float64: w_i of this process's rows, in their local order
    policy_partials: tuple[float, ...]  # [windows]: this process's share of N (policy term)
    token_partials: tuple[float, ...]  # [windows]: this process's tokens (token_mean terms)


def _per_window(values: Tensor, window: Tensor, n_windows: int) -> tuple[float, ...]:
    sums = torch.zeros(n_windows, dtype=torch.float64).index_add(0, window, values)
    return tuple(float(v) for v in sums.tolist())


def plan_rows(
    reduction: PolicyGradientReduction, rows: StepRows, rank: int, n_windows: int
) -> RowPlan:
    """Row weights and partials of process ``rank`` for every window of ``rows``."""
    tokens = rows.tokens.to(torch.float64).cpu()
    window, group, process = rows.window.cpu(), rows.group.cpu(), rows.process.cpu()
    active = tokens > 0  # [R]
    mine = process == rank  # [R]
    mine_active = (mine & active).to(torch.float64)  # [R]
    mode = reduction.mode
    if mode is PolicyGradientMode.TOKEN_MEAN:
        weights = active.to(torch.float64)
        policy_partials = _per_window(torch.where(mine, tokens, 0.0), window, n_windows)
    elif mode is PolicyGradientMode.SEQ_MEAN:
        weights = torch.where(active, 1.0 / tokens.clamp(min=1), 0.0)
        policy_partials = _per_window(mine_active, window, n_windows)
    elif mode is PolicyGradientMode.CONSTANT:
        assert reduction.divisor is not None
        weights = active.to(torch.float64) / reduction.divisor
        policy_partials = _per_window(mine_active, window, n_windows)
    else:
        # One key per (window, group): a group split across optimizer steps
        # is a separate group in each of them.
        n_groups = int(group.max()) + 1 if group.numel() else 0
        key = window * n_groups + group  # [R]
        n_keys = n_windows * n_groups
        group_tokens = torch.zeros(n_keys, dtype=torch.float64).index_add(0, key, tokens)  # [K]
        row_group_tokens = group_tokens[key]  # [R]: D_g of each row's group
        weights = torch.where(row_group_tokens > 0, 1.0 / row_group_tokens.clamp(min=1), 0.0)
        # A group is counted by the lowest process holding an active row of it,
        # so the partials of all processes sum to the number of active groups.
        nobody = torch.iinfo(torch.int64).max
        owner = torch.full((n_keys,), nobody, dtype=torch.int64).scatter_reduce(
            0, key, torch.where(active, process, nobody), "amin"
        )  # [K]
        owned = (owner == rank).to(torch.float64)  # [K]
        key_window = torch.div(torch.arange(n_keys), max(n_groups, 1), rounding_mode="floor")
        policy_partials = _per_window(owned, key_window, n_windows)
    return RowPlan(
        weights=weights[mine],
        policy_partials=policy_partials,
        token_partials=_per_window(torch.where(mine, tokens, 0.0), window, n_windows),
    )


@dataclass(frozen=True)
class TermPlan:
    """One process's share of one optimizer step with several terms, each reduced in
    its own mode: per term, the weights of its rows, its partial and its contract."""

    weights: dict[str, Tensor]  # term -> [R_local] float64: w_i of this process's rows
    partials: dict[str, Tensor]  # term -> this process's partial normalizer, float64 0-d
    contracts: dict[str, str]  # term -> its contract (what processes compare)


def plan_terms(
    reductions: Mapping[str, PolicyGradientReduction], rows: StepRows, rank: int
) -> TermPlan:
    """:func:`plan_rows` of one window for every term of ``reductions`` (term -> its
    reduction). ``rows`` holds every process's rows when a term is in ``prompt_mean``
    (a group's tokens and its owner span processes), else this process's alone."""
    weights: dict[str, Tensor] = {}
    partials: dict[str, Tensor] = {}
    contracts: dict[str, str] = {}
    for term, reduction in reductions.items():
        plan = plan_rows(reduction, rows, rank, n_windows=1)
        weights[term] = plan.weights
        partials[term] = torch.tensor(plan.policy_partials[0], dtype=torch.float64)
        contracts[term] = reduction.contract_for("sum")
    return TermPlan(weights=weights, partials=partials, contracts=contracts)


def group_ids(uids: list[str]) -> list[int]:
    """Each row's prompt group as an int, numbered in order of first appearance."""
    index: dict[str, int] = {}
    return [index.setdefault(u, len(index)) for u in uids]


def bad_inputs(
    mask: Tensor,
    inputs: Mapping[str, Tensor],
    rank: int = 0,
    *,
    rows: Tensor | None = None,
    share: int | None = None,
    batch: str = "mini-batch",
) -> list[str]:
    """Each input (``[B, T]``, like ``mask``) with a NaN or inf where ``mask`` is set,
    as ``"advantages: nan at 3 active tokens of rank 1 rows [1, 4] (mini-batch rows
    [5, 8])"``; masked positions are ignored (they are zeroed before the loss).

    Rows are named as the trainer dispatched them: ``rows`` (``[B]``) gives each of
    ``mask``'s rows its index in the ``batch`` the trainer sent, whatever order the
    framework put them in since (a shuffle, a length-balanced split), and ``share`` how
    many of that batch's rows each rank was sent (rank ``r``'s ``i``-th row is
    ``r * share + i``). Without them ``mask`` holds rank ``rank``'s rows of a batch split
    into equal chunks in rank order (verl's and SkyRL's dispatch): row ``i`` is the
    batch's ``rank * B + i``."""
    if rows is None:
        rows = rank * mask.shape[0] + torch.arange(mask.shape[0])  # [B]
    share = mask.shape[0] if share is None else share
    active = mask.bool()
    found = []
    for name, values in inputs.items():
        bad = active & ~torch.isfinite(values)  # [B, T]
        count = int(bad.sum())
        if count:
            first = float(values[bad][0])
            overall = sorted({int(rows[r]) for r in bad.nonzero()[:, 0].tolist()})
            own = [r - rank * share for r in overall]
            what = "nan" if math.isnan(first) else repr(first)
            found.append(
                f"{name}: {what} at {count} active tokens of rank {rank} rows {own} "
                f"({batch} rows {overall})"
            )
    return found
