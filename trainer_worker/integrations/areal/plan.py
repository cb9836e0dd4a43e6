"""What one AReaL ``train_batch`` call sends and how its tokens are weighted (pure torch).

AReaL hands ``train_batch`` one optimizer step's padded batch (``[B, T]``
tensors: ``loss_mask``, ``advantages``, ``logprobs``, ...). Before any forward
this module turns it into

- one partial normalizer per term: ``pg`` (the policy gradient in the
  configured mode), ``distill`` (AReaL's teacher reverse-KL penalty, a
  ``token_mean`` term of its own, where the batch has ``teacher_logp``) and
  ``rows`` (how many sequences the rank trains on; the engine's own weight
  bookkeeping, see :mod:`.actor`);
- the per-row weight ``w_i`` of :mod:`lossreduce.trainer_worker.step_rows`
  (1, ``1/D_i``, ``1/D_g`` or ``1/C``), so the step's policy-gradient loss is
  ``sum_i w_i * sum_t l[i,t] * m[i,t] / N_pg``: the formula of
  docs/reduction-semantics.md over the step's responses, however AReaL cuts
  them into micro-batches and ranks;
- the problems of this rank's inputs that would otherwise only show up as a
  silently skipped (or silently wrong) step: a NaN advantage or
  log-probability at an active token, a loss mask that is not 0/1, a
  ``loss_weight_fn`` value that is NaN, infinite, negative or disagrees with
  the mask (in every mode), which the actor turns into the same error on
  every rank before any backward.

Prompt groups are the rows AReaL's rollout produced for one prompt: the
actor numbers the trajectory dicts ``ppo_update`` receives (one per rollout
episode) in ``GROUP_KEY``. A group therefore never spans ranks; when
``ppo_n_minibatches > 1`` splits a group between two optimizer steps, each
part is that step's group (the rows a step trains on are all it can count).

A problem names its row by its place in the batch the rank's ``ppo_update``
received (``ROW_KEY``, which the actor adds there): AReaL splits that batch
into ``ppo_n_minibatches`` optimizer steps by balancing their lengths
(``split_padded_tensor_dict_into_mb_list``), not in order, so a row's place in
the step's batch is not where the user finds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows, plan_rows

__all__ = [
    "DISTILL_TERM",
    "GROUP_KEY",
    "POLICY_TERM",
    "ROWS_TERM",
    "ROW_KEY",
    "WEIGHT_KEY",
    "BatchPlan",
    "input_problems",
    "plan_batch",
    "token_weights",
    "weight_problems",
]

POLICY_TERM = "pg"
DISTILL_TERM = "distill"
ROWS_TERM = "rows"

GROUP_KEY = "lossreduce_group"
"""[B, T] int64: the row's rollout episode (prompt group) within its rank's ppo_update."""
ROW_KEY = "lossreduce_row"
"""[B, T] int64: the row's place in the batch its rank's ``ppo_update`` received (its
trajectory dicts concatenated in order); problems name rows by it."""
WEIGHT_KEY = "lossreduce_weight"
"""[B, T] float64: each token's weight ``w_i / N_pg`` in the step's policy-gradient loss."""

# Loss inputs that must be finite wherever the loss mask is set.
_LOSS_INPUTS = ("advantages", "logprobs", "prox_logp", "teacher_logp")
_SHOWN = 3  # offending positions named per input


@dataclass(frozen=True)
class BatchPlan:
    """One rank's share of one optimizer step."""

    partials: dict[str, float]  # term -> this rank's partial normalizer
    contracts: dict[str, str]  # term -> how it is reduced (ranks compare these)
    row_weights: Tensor  # [B] float64: w_i of each row (before the division by N_pg)
    problems: tuple[str, ...]  # why this rank's inputs cannot be trained on (empty: none)


def _row_names(batch: Mapping[str, Any], rows: int) -> list[int]:
    """Each row's name: its ``ROW_KEY`` where the batch has one, else its place here."""
    given = batch.get(ROW_KEY)
    if isinstance(given, Tensor) and given.dim() in (1, 2) and given.shape[0] == rows:
        column = given[:, 0] if given.dim() == 2 else given  # [B]
        return [int(r) for r in column.tolist()]
    return list(range(rows))


def _positions(bad: Tensor, names: list[int]) -> str:
    """``(row, position)`` of the first offending entries of a [B, T] bool tensor, each
    row by its name (:func:`_row_names`)."""
    where = bad.nonzero().tolist()[:_SHOWN]
    more = int(bad.sum()) - len(where)
    text = ", ".join(f"(row {names[r]}, position {t})" for r, t in where)
    return text + (f" and {more} more" if more > 0 else "")


def input_problems(batch: Mapping[str, Any], active: Tensor) -> list[str]:
    """Non-finite loss inputs at active tokens (``active`` [B, T] bool), named by row
    (as ``ppo_update`` received it, where the batch carries ``ROW_KEY``) and position."""
    names = _row_names(batch, int(active.shape[0]))
    problems = []
    for key in _LOSS_INPUTS:
        values = batch.get(key)
        if not isinstance(values, Tensor) or values.shape != active.shape:
            continue
        bad = active & ~torch.isfinite(values)
        if bool(bad.any()):
            first = values[bad][0].item()
            problems.append(f"{key} is {first} at active token {_positions(bad, names)}")
    return problems


def _mask_problems(mask: Tensor, names: list[int]) -> list[str]:
    bad = (mask != 0) & (mask != 1)
    if not bool(bad.any()):
        return []
    first = mask[bad][0].item()
    return [f"loss_mask holds {first} at {_positions(bad, names)}; a loss mask is 0 or 1"]


def weight_problems(token_weight: float, counted: float) -> list[str]:
    """Why ``loss_weight_fn``'s value for the whole batch cannot be trained on.

    ``counted`` is the batch's active-token count. Every mode checks it: outside
    ``token_mean`` the weight is not a partial, yet the engine still divides
    each micro-batch's loss by it, so a NaN, inf or negative weight would turn
    the step NaN (skipped silently) or flip its sign.
    """
    if not math.isfinite(token_weight) or token_weight < 0:
        return [
            f"loss_weight_fn gives {token_weight} for a batch whose loss mask holds {counted:.0f} "
            "active tokens; a weight must be finite and >= 0"
        ]
    if token_weight != counted:
        return [
            f"loss_weight_fn gives {token_weight} for a batch whose loss mask holds {counted:.0f} "
            "active tokens; LossReduce actors need AReaL's token-count weight"
        ]
    return []


def _groups(batch: Mapping[str, Any], rows: int, mode: PolicyGradientMode) -> tuple[Tensor, str]:
    """[B] int64 group of each row, and why it could not be read (empty: it could)."""
    groups = batch.get(GROUP_KEY)
    if groups is None:
        if mode is PolicyGradientMode.PROMPT_MEAN:
            return torch.zeros(rows, dtype=torch.int64), (
                f"mode 'prompt_mean' needs the batch's prompt groups in {GROUP_KEY!r}; "
                "LossReduce actors add it in ppo_update (one group per trajectory dict), "
                "so train_batch called directly must carry it"
            )
        return torch.zeros(rows, dtype=torch.int64), ""
    column = groups[:, 0] if groups.dim() == 2 else groups  # [B]
    if column.shape != (rows,) or bool((column < 0).any()):
        return torch.zeros(rows, dtype=torch.int64), (
            f"{GROUP_KEY} must hold one non-negative group per row ([B] or [B, T]), "
            f"got shape {tuple(groups.shape)}"
        )
    # Compact ids, so step_rows' per-group tables stay as small as the batch.
    _, compact = torch.unique(column.to("cpu", torch.int64), return_inverse=True)
    return compact, ""


def plan_batch(
    reduction: PolicyGradientReduction, batch: Mapping[str, Any], token_weight: float
) -> BatchPlan:
    """This rank's partials, row weights and input problems for ``batch``.

    ``token_weight`` is the caller's ``loss_weight_fn`` over the whole batch
    (AReaL's token count): the denominator of AReaL's own per-micro-batch
    mean, and the ``token_mean`` partial. An invalid one (NaN, inf, negative)
    is a problem in every mode, and is sent as the ``pg`` partial in every
    mode, so the peers' RoundAbortedError names its value too.
    """
    mask = batch["loss_mask"]  # [B, T]
    rows = int(mask.shape[0])
    problems = _mask_problems(mask, _row_names(batch, rows))
    active = mask != 0  # [B, T]
    problems += input_problems(batch, active)
    tokens = active.sum(-1).to("cpu", torch.float64)  # [B]: D_i
    problems += weight_problems(token_weight, float(tokens.sum()))
    groups, why = _groups(batch, rows, reduction.mode)
    if why:
        problems.append(why)
    zeros = torch.zeros(rows, dtype=torch.int64)
    plan = plan_rows(
        reduction, StepRows(process=zeros, window=zeros, group=groups, tokens=tokens), 0, 1
    )
    # An invalid weight is sent as the partial in every mode (whatever the
    # mode's own unit), so the round names it, with its value, on every rank.
    weight_valid = math.isfinite(token_weight) and token_weight >= 0
    pg = (
        token_weight
        if reduction.mode is PolicyGradientMode.TOKEN_MEAN or not weight_valid
        else plan.policy_partials[0]
    )
    partials = {POLICY_TERM: pg, ROWS_TERM: float(rows)}
    contracts = {POLICY_TERM: reduction.contract_for("mean"), ROWS_TERM: "sum:rows"}
    if isinstance(batch.get("teacher_logp"), Tensor):
        partials[DISTILL_TERM] = token_weight
        contracts[DISTILL_TERM] = PolicyGradientReduction("token_mean").contract_for("mean")
    return BatchPlan(partials, contracts, plan.weights, tuple(problems))


def token_weights(plan: BatchPlan, normalizers: Mapping[str, float], like: Tensor) -> Tensor:
    """[B, T] float64 weight ``w_i / N_pg`` of every token, shaped and placed like ``like``."""
    per_row = plan.row_weights / normalizers[POLICY_TERM]  # [B]
    return per_row.to(like.device)[:, None].expand(like.shape).contiguous()
