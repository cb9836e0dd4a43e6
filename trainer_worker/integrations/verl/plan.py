"""One PPO mini-batch's row weights, partial normalizers and input check: pure torch.

verl's engine splits a rank's mini-batch into micro-batches itself (by count,
or by token budget with ``use_dynamic_bsz``, reordering rows), so nothing that
depends on the split may enter the loss. Here the whole mini-batch is seen
once, before that split, and the policy-gradient term is written as a sum over
its rows (``D_i`` = tokens of row ``i`` under the response mask):

    pg = (sum over rows i of w_i * sum_t l[i,t] * m[i,t]) / N

with the weights and partials of :func:`lossreduce.trainer_worker.step_rows.plan_rows`
(``token_mean``: ``w_i = 1``; ``seq_mean``: ``1 / D_i``; ``prompt_mean``:
``1 / D_g`` of the row's group over every rank; ``constant``: ``1 / C``). A
row without active tokens has weight 0 and is counted nowhere. The KL and
entropy terms are token means, each with its own normalizer (the tokens).

A bad input is named by the rows as the trainer dispatched them
(:func:`dispatched_bad_inputs`): verl's data loader may reorder a rank's share before
the check (``actor.shuffle``, ``critic.shuffle``) and splits it into mini-batches, so a
row's place in the mini-batch the check sees is not where the user finds it.

No verl, gRPC or process group here: the worker gathers what ranks must share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows, bad_inputs, group_ids, plan_rows

__all__ = [
    "ENTROPY_TERM",
    "KL_TERM",
    "POLICY_TERM",
    "VALUE_TERM",
    "MiniBatchPlan",
    "bad_inputs",
    "dispatched_bad_inputs",
    "group_ids",
    "plan_mini_batch",
]

POLICY_TERM = "pg"
VALUE_TERM = "vf"
"""The critic's value loss (group ``critic``)."""
KL_TERM = "kl"
ENTROPY_TERM = "entropy"


@dataclass(frozen=True)
class MiniBatchPlan:
    """What one rank needs for one mini-batch: its rows' weights and its partials."""

    weights: Tensor  # [B] float64: w_i of this rank's rows, in their order
    partials: dict[str, Tensor]  # term -> this rank's partial normalizer, float64 0-d
    contracts: dict[str, str]  # term -> its contract (what ranks compare)


def plan_mini_batch(
    reduction: PolicyGradientReduction,
    rows: StepRows,
    rank: int,
    *,
    kl: bool,
    entropy: bool,
    main_term: str = POLICY_TERM,
) -> MiniBatchPlan:
    """Row weights and partials of rank ``rank`` for the mini-batch ``rows``.

    ``rows`` holds every rank's rows for ``prompt_mean`` (a group's tokens and
    its owner span ranks) and may hold this rank's rows alone otherwise.
    ``main_term`` names the term ``reduction`` normalizes (the critic's is
    :data:`VALUE_TERM`).
    """
    plan = plan_rows(reduction, rows, rank, n_windows=1)
    token_mean = PolicyGradientReduction("token_mean").contract_for("sum")
    partials = {main_term: torch.tensor(plan.policy_partials[0], dtype=torch.float64)}
    contracts = {main_term: reduction.contract_for("sum")}
    tokens = torch.tensor(plan.token_partials[0], dtype=torch.float64)
    for term, wanted in ((KL_TERM, kl), (ENTROPY_TERM, entropy)):
        if wanted:
            partials[term] = tokens.clone()
            contracts[term] = token_mean
    return MiniBatchPlan(weights=plan.weights, partials=partials, contracts=contracts)


def dispatched_bad_inputs(
    mask: Tensor, inputs: Mapping[str, Tensor], rank: int, rows: Tensor, share: int
) -> list[str]:
    """Each input (``[B, T]``, like ``mask``) with a NaN or inf where ``mask`` is set, its
    rows named as the trainer dispatched them: ``"returns: nan at 1 active tokens of rank 1
    rows [2] (mini-batch rows [6])"``, rank 1's row 2 of the ``share`` rows it was sent, row
    6 of the batch the trainer sent (verl's ``train_mini_batch``); masked positions are
    ignored (they are zeroed before the loss).

    ``rows``: ``[B]`` each row's index in that batch (``rank * share + i`` for the rank's
    ``i``-th row), in the order of ``mask``'s rows, whatever order verl put them in."""
    return bad_inputs(mask, inputs, rank, rows=rows, share=share)
