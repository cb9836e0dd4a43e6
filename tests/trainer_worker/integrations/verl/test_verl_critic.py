"""LossReduceCriticWorker (PPO with a critic) against verl 0.9.1's real critic worker on CPU.

verl's ``TrainingWorker`` with a value model (the tiny Qwen2 with a one-label token
classification head, saved whole so every build loads the same weights) runs one
critic mini-batch per case with plain SGD at lr 1. The value loss is verl's own
(``compute_value_loss``); lossreduce gives it a normalizer of its own (term ``vf``, group
``critic``) in every mode, checked against the formulas of
:func:`policy_references.value_update`, over 1 and 2 ranks and micro-batch layouts, and
against stock verl's critic where the two mean the same (``token_mean``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_worker.integrations.verl import policy_references, tiny_verl
from tests.trainer_worker.integrations.verl.verl_runs import (
    CLIPRANGE_VALUE,
    LR,
    VALUE_MODEL,
    Case,
    LayoutRuns,
    is_zero,
    relative,
)

UPDATE_RTOL = 1e-6
FORMULA_RTOL = 1e-5
MODES: dict[str, float | None] = {
    "token_mean": None,
    "seq_mean": None,
    "prompt_mean": None,
    "constant": float(tiny_verl.RESPONSE_LEN),
}
# 22 active tokens, 7 active responses of 8, 2 prompt groups.
COUNTS = {"token_mean": 22.0, "seq_mean": 7.0, "prompt_mean": 2.0, "constant": 7.0}


def critic(name: str, mode: str = "token_mean", **fields: object) -> Case:
    return Case(name, role="critic", mode=mode, divisor=MODES[mode], **fields)  # type: ignore[arg-type]


def dp1_cases() -> list[Case]:
    return [
        *(critic(f"critic-{mode}", mode) for mode in MODES),
        critic("critic-dp1-dyn", "prompt_mean", micro=4, dynamic=True),
        # Stock verl's critic, the whole mini-batch in one call.
        Case("verl-critic", role="critic", worker="verl", micro=tiny_verl.BATCH),
        Case("verl-critic-mb2", role="critic", worker="verl", micro=2),
        *bad_row_cases(1),
    ]


def bad_row_cases(world: int) -> list[Case]:
    """A NaN return in row 6 with 2 mini-batches a step, verl's loader shuffling each
    rank's share (``critic.shuffle``) or not (2 ranks without: ``critic-nan``)."""
    cases = [
        critic(
            f"critic-nan-dp{world}-shuffled",
            batch="nan_return",
            mini_batches=2,
            shuffle=True,
            loader_seed=tiny_verl.SHUFFLE_SEED,
        )
    ]
    if world == 1:
        cases.append(critic("critic-nan-dp1", batch="nan_return", mini_batches=2))
    return cases


def dp2_cases(target: str) -> list[Case]:
    return [
        critic("critic-dp2-mb1", micro=1),
        critic("critic-prompt_mean-dp2-mb2", "prompt_mean"),
        critic("critic-prompt_mean-dp2-dyn", "prompt_mean", dynamic=True),
        critic("critic-nan", "prompt_mean", batch="nan_return"),
        *bad_row_cases(2),
        critic("critic-empty-raise", batch="all_masked"),
        critic("critic-empty-skip", batch="all_masked", on_empty_step="skip", optimizer="adamw"),
        critic("critic-rank1-masked", "seq_mean", batch="rank1_masked"),
        critic("critic-coordinator", "prompt_mean", normalizer="coordinator", coordinator=target),
    ]


@pytest.fixture(scope="module")
def results(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> LayoutRuns:
    return LayoutRuns(
        lambda world: dp2_cases(coordinator_target) if world == 2 else dp1_cases(),
        model_dir,
        tmp_path_factory.mktemp("critic"),
    )


def formula(model_dir: Path, batch: tiny_verl.Rows, mode: str) -> dict[str, torch.Tensor]:
    return policy_references.value_update(
        model_dir / VALUE_MODEL, batch, mode, MODES[mode], cliprange=CLIPRANGE_VALUE, lr=LR
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_the_value_loss_equals_the_formula_in_every_mode(
    results: LayoutRuns, model_dir: Path, mode: str
) -> None:
    (got,) = results.case(1, f"critic-{mode}")
    assert got["normalizers"] == {"vf": COUNTS[mode]}
    assert relative(got["update"], formula(model_dir, tiny_verl.rows(), mode)) <= FORMULA_RTOL


@pytest.mark.parametrize(
    ("world", "case", "base"),
    [
        (1, "critic-dp1-dyn", "critic-prompt_mean"),
        (2, "critic-dp2-mb1", "critic-token_mean"),
        (2, "critic-prompt_mean-dp2-mb2", "critic-prompt_mean"),
        (2, "critic-prompt_mean-dp2-dyn", "critic-prompt_mean"),
    ],
)
def test_the_critic_trains_the_same_whatever_the_split(
    results: LayoutRuns, world: int, case: str, base: str
) -> None:
    (want,) = results.case(1, base)
    for got in results.case(world, case):
        assert got["normalizers"] == want["normalizers"]
        assert relative(got["update"], want["update"]) <= UPDATE_RTOL


def test_equals_stock_verls_critic_in_token_mean(results: LayoutRuns) -> None:
    """verl's value_loss divides by its batch_num_tokens (22, the same count)."""
    (ours,) = results.case(1, "critic-token_mean")
    for stock in ("verl-critic", "verl-critic-mb2"):
        (theirs,) = results.case(1, stock)
        assert relative(ours["update"], theirs["update"]) <= UPDATE_RTOL


def test_a_nan_return_stops_every_rank_before_any_backward(results: LayoutRuns) -> None:
    culprit, peer = results.case(2, "critic-nan", ok=False)[::-1]
    assert culprit["error"]["type"] == "InvalidPartialError", culprit.get("traceback")
    assert culprit["error"]["rank"] == 1
    assert "returns: nan at 1 active tokens of rank 1 rows [2]" in culprit["error"]["message"]
    assert culprit["error"]["terms"] == ("vf",)
    assert peer["error"]["type"] == "RoundAbortedError", peer.get("traceback")
    for got in (culprit, peer):
        assert is_zero(got["update"])


@pytest.mark.parametrize(
    ("world", "case", "shuffle"),
    [
        (1, "critic-nan-dp1", False),
        (1, "critic-nan-dp1-shuffled", True),
        (2, "critic-nan", False),
        (2, "critic-nan-dp2-shuffled", True),
    ],
)
def test_a_bad_row_is_named_as_the_trainer_dispatched_it(
    results: LayoutRuns, world: int, case: str, shuffle: bool
) -> None:
    """Row 6 of the batch, wherever verl's loader put it: in the second of two mini-batches
    (one rank), reordered by ``critic.shuffle``."""
    rank = world - 1
    mini_batches = 1 if case == "critic-nan" else 2
    if shuffle:
        assert tiny_verl.shuffle_moves(6, world, mini_batches)
    culprit = results.case(world, case, ok=False)[rank]
    assert culprit["error"]["type"] == "InvalidPartialError", culprit.get("traceback")
    assert tiny_verl.bad_row("returns", 6, world) in culprit["error"]["message"]
    assert culprit["error"]["terms"] == ("vf",)


def test_an_empty_critic_mini_batch_raises_everywhere_or_is_skipped(
    results: LayoutRuns,
) -> None:
    for got in results.case(2, "critic-empty-raise", ok=False):
        assert got["error"]["type"] == "EmptyNormalizerError", got.get("traceback")
        assert is_zero(got["update"])
    for got in results.case(2, "critic-empty-skip"):
        assert got["skipped_steps"] == 1
        assert is_zero(got["update"])
        assert got["optimizer"] == {}


def test_a_rank_without_active_tokens_takes_part(results: LayoutRuns, model_dir: Path) -> None:
    batch = tiny_verl.rows()
    batch.response_mask[4:] = 0
    want = formula(model_dir, batch, "seq_mean")
    for got in results.case(2, "critic-rank1-masked"):
        assert got["normalizers"] == {"vf": 4.0}
        assert relative(got["update"], want) <= FORMULA_RTOL


def test_the_coordinator_gives_the_torch_backends_update_bit_for_bit(
    results: LayoutRuns,
) -> None:
    for got, want in zip(
        results.case(2, "critic-coordinator"),
        results.case(2, "critic-prompt_mean-dp2-mb2"),
        strict=True,
    ):
        assert got["normalizers"] == want["normalizers"]
        for name, delta in want["update"].items():
            assert torch.equal(got["update"][name], delta), name
