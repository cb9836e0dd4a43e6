"""Row weights and partials for prompt groups split across processes and micro-steps.

The expected values are the mode definitions evaluated row by row in plain
Python; the partials of all processes must sum to the global normalizer.
"""

from __future__ import annotations

import random

import pytest
import torch

from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows, plan_rows

MODES = [("token_mean", None), ("seq_mean", None), ("prompt_mean", None), ("constant", 8.0)]


def random_rows(seed: int, processes: int, rows_per_process: int, windows: int) -> StepRows:
    rng = random.Random(seed)
    total = processes * rows_per_process
    # Groups of 4 consecutive rows (as TRL numbers them), so groups straddle processes
    # when rows_per_process is not a multiple of 4; windows are drawn per row, as
    # TRL's shuffle deals them.
    return StepRows(
        process=torch.tensor([i // rows_per_process for i in range(total)]),
        window=torch.tensor([rng.randrange(windows) for _ in range(total)]),
        group=torch.tensor([i // 4 for i in range(total)]),
        tokens=torch.tensor([float(rng.choice([0, 0, 1, 3, 6])) for _ in range(total)]),
    )


def expected(
    mode: str, divisor: float | None, rows: StepRows, window: int
) -> tuple[dict[int, float], float]:
    """(row index -> w_i, N) of one window, from the definitions."""
    members = [i for i in range(len(rows.tokens)) if int(rows.window[i]) == window]
    tokens = {i: float(rows.tokens[i]) for i in members}
    active = [i for i in members if tokens[i] > 0]
    if mode == "token_mean":
        return dict.fromkeys(active, 1.0), sum(tokens[i] for i in active)
    if mode == "seq_mean":
        return {i: 1 / tokens[i] for i in active}, float(len(active))
    if mode == "constant":
        assert divisor is not None
        return dict.fromkeys(active, 1 / divisor), float(len(active))
    group_tokens: dict[int, float] = {}
    for i in active:
        group_tokens[int(rows.group[i])] = group_tokens.get(int(rows.group[i]), 0.0) + tokens[i]
    return {i: 1 / group_tokens[int(rows.group[i])] for i in active}, float(len(group_tokens))


@pytest.mark.parametrize(("mode", "divisor"), MODES)
@pytest.mark.parametrize("seed", range(6))
def test_weights_and_partials_follow_the_definitions(
    mode: str, divisor: float | None, seed: int
) -> None:
    processes, per_process, windows = 3, 6, 2
    rows = random_rows(seed, processes, per_process, windows)
    reduction = PolicyGradientReduction(mode, divisor)
    plans = [plan_rows(reduction, rows, rank, windows) for rank in range(processes)]
    for w in range(windows):
        weights, n = expected(mode, divisor, rows, w)
        assert sum(p.policy_partials[w] for p in plans) == n
        tokens = sum(float(t) for t, win in zip(rows.tokens, rows.window, strict=True) if win == w)
        assert sum(p.token_partials[w] for p in plans) == tokens
        for rank, plan in enumerate(plans):
            for local, weight in enumerate(plan.weights.tolist()):
                index = rank * per_process + local
                if index in weights:
                    assert weight == pytest.approx(weights[index], rel=1e-15)


def test_a_group_split_across_processes_counts_once() -> None:
    rows = StepRows(
        process=torch.tensor([0, 0, 1, 1]),
        window=torch.tensor([0, 0, 0, 0]),
        group=torch.tensor([0, 0, 0, 0]),
        tokens=torch.tensor([2.0, 0.0, 3.0, 5.0]),
    )
    reduction = PolicyGradientReduction("prompt_mean")
    first, second = (plan_rows(reduction, rows, rank, 1) for rank in (0, 1))
    assert (first.policy_partials, second.policy_partials) == ((1.0,), (0.0,))
    assert first.weights[0] == second.weights[0] == 0.1  # 1 / (2 + 3 + 5)


def test_a_process_without_active_rows_sends_zero() -> None:
    rows = StepRows(
        process=torch.tensor([0, 1]),
        window=torch.tensor([0, 0]),
        group=torch.tensor([0, 0]),
        tokens=torch.tensor([0.0, 4.0]),
    )
    for mode, divisor in MODES:
        plan = plan_rows(PolicyGradientReduction(mode, divisor), rows, 0, 1)
        assert plan.policy_partials == (0.0,)
        assert plan.token_partials == (0.0,)
