"""LossReduceTrainingWorker against verl 0.9.1's real engine worker on CPU.

verl's ``TrainingWorker`` with its FSDP2 engine runs one PPO mini-batch
(``train_mini_batch``) per case on a tiny Qwen2, on one rank and on two gloo
ranks, and the tests read the cached results. With plain SGD (lr 1) the update
is minus the gradient, so the expected update comes from
:func:`tiny_verl.reference_grads`, the formulas of the reduction semantics
evaluated on the whole mini-batch in one process, without verl. Every case has
the KL loss and the entropy bonus on unless it says otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_worker.integrations.verl import tiny_verl
from tests.trainer_worker.integrations.verl.verl_runs import (
    LR,
    Case,
    LayoutRuns,
    is_zero,
    relative,
)

DIVISOR = float(tiny_verl.RESPONSE_LEN)
MODES: dict[str, float | None] = {
    "token_mean": None,
    "seq_mean": None,
    "prompt_mean": None,
    "constant": DIVISOR,
}
# (ranks, micro-batch size per rank, use_dynamic_bsz): 8 responses in one mini-batch.
SPLITS: dict[str, tuple[int, int, bool]] = {
    "dp1-mb4": (1, 4, False),
    "dp1-dyn": (1, 4, True),
    "dp2-mb1": (2, 1, False),
    "dp2-mb2": (2, 2, False),
    "dp2-dyn": (2, 2, True),
}
# verl's own modes, measured on the same data (the docs' table): name -> Case fields.
VERL_MODES: dict[str, dict[str, Any]] = {
    "token-mean": {"loss_agg_mode": "token-mean"},
    "token-sum": {"loss_agg_mode": "token-sum"},
    "seq-mean-token-sum": {"loss_agg_mode": "seq-mean-token-sum"},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean"},
    "seq-mean-token-sum-norm": {
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "loss_scale_factor": tiny_verl.RESPONSE_LEN,
    },
}
UPDATE_RTOL = 1e-6
"""|update - other| / |other| over all parameters between two verl runs (splits,
backends, verl's own modes): float32 reordering is ~2e-7 here; a wrong normalizer
is off by 1/8 or more."""
FORMULA_RTOL = 1e-5
"""The same against the one-process reference (Hugging Face's forward, not verl's
engine): ~5e-7 with every term, up to ~2e-6 for the smaller policy-gradient-only update."""
PG_ONLY: dict[str, Any] = {"kl": False, "entropy_coeff": 0.0}


def split_cases(world: int) -> list[Case]:
    return [
        Case(f"{mode}-{split}", mode=mode, divisor=divisor, micro=micro, dynamic=dynamic)
        for split, (ranks, micro, dynamic) in SPLITS.items()
        if ranks == world
        for mode, divisor in MODES.items()
    ]


def verl_mode_cases(world: int) -> list[Case]:
    split = "dp2-mb2" if world == 2 else "dp1-mb4"
    micro = SPLITS[split][1]
    cases = [
        Case(f"verl-{agg}-{split}", worker="verl", micro=micro, **fields)
        for agg, fields in VERL_MODES.items()
    ]
    if world == 2:
        cases += [
            Case(
                f"verl-{agg}-empty", worker="verl", batch="all_masked", optimizer="adamw", **fields
            )
            for agg, fields in VERL_MODES.items()
        ]
    return cases


def dp2_cases(target: str) -> list[Case]:
    return [
        *split_cases(2),
        *verl_mode_cases(2),
        # verl's own modes next to lossreduce's on the same data.
        Case(
            "verl-seq-mean-dense",
            worker="verl",
            loss_agg_mode="seq-mean-token-mean",
            batch="dense",
            **PG_ONLY,
        ),
        Case("seq_mean-dense", mode="seq_mean", batch="dense", **PG_ONLY),
        Case(
            "verl-sum-norm-dense",
            worker="verl",
            loss_agg_mode="seq-mean-token-sum-norm",
            loss_scale_factor=tiny_verl.RESPONSE_LEN,
            batch="dense",
            **PG_ONLY,
        ),
        Case("constant-dense", mode="constant", divisor=DIVISOR, batch="dense", **PG_ONLY),
        # One response of 8 fully masked: verl still divides by 8.
        Case("verl-seq-mean", worker="verl", loss_agg_mode="seq-mean-token-mean", **PG_ONLY),
        Case("seq_mean-pg", mode="seq_mean", **PG_ONLY),
        Case("verl-seq-sum", worker="verl", loss_agg_mode="seq-mean-token-sum", **PG_ONLY),
        Case("constant1-pg", mode="constant", divisor=1.0, **PG_ONLY),
        # Bad input.
        Case("rank1-masked", mode="seq_mean", batch="rank1_masked"),
        Case("nan-advantage", mode="prompt_mean", batch="nan_advantage"),
        *bad_row_cases(2),
        # Backends, epochs and mini-batches (the contract's cases are in test_contract.py).
        # No address: the ranks start or join the job's coordinator actor on their Ray cluster.
        Case("joined-coordinator", mode="prompt_mean", normalizer="coordinator"),
        Case(
            "coordinator-skip",
            batch="all_masked",
            on_empty_step="skip",
            optimizer="adamw",
            normalizer="coordinator",
            coordinator=target,
        ),
        Case("two-epochs-two-mini-batches", mode="prompt_mean", epochs=2, mini_batches=2),
    ]


def bad_row_cases(world: int) -> list[Case]:
    """A NaN advantage in row 6 with 2 mini-batches a step, verl's loader shuffling each
    rank's share (``actor.shuffle``) or not (2 ranks without: ``nan-advantage``)."""
    bad = {"mode": "prompt_mean", "batch": "nan_advantage", "mini_batches": 2}
    shuffled = Case(
        f"nan-advantage-dp{world}-shuffled",
        shuffle=True,
        loader_seed=tiny_verl.SHUFFLE_SEED,
        **bad,  # type: ignore[arg-type]
    )
    cases = [shuffled]
    if world == 1:
        cases.append(Case("nan-advantage-dp1", **bad))  # type: ignore[arg-type]
    return cases


def dp1_cases() -> list[Case]:
    return [
        *split_cases(1),
        *verl_mode_cases(1),
        *bad_row_cases(1),
        Case(
            "two-epochs-two-mini-batches",
            mode="prompt_mean",
            epochs=2,
            mini_batches=2,
            batch="interleaved",
        ),
    ]


@pytest.fixture(scope="module")
def results(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> LayoutRuns:
    """ranks -> every rank's results of its cases (run once per module)."""
    return LayoutRuns(
        lambda world: dp2_cases(coordinator_target) if world == 2 else dp1_cases(),
        model_dir,
        tmp_path_factory.mktemp("layouts"),
        ray_for=frozenset({2}),
    )


def case_results(
    results: LayoutRuns, world: int, case: str, *, ok: bool = True
) -> list[dict[str, Any]]:
    return results.case(world, case, ok=ok)


def reference_update(
    model_dir: Path, batch: tiny_verl.Rows, mode: str, **terms: float
) -> dict[str, torch.Tensor]:
    grads = tiny_verl.reference_grads(model_dir, batch, mode, MODES[mode], **terms)
    return {n: -LR * g for n, g in grads.items()}


# -- split invariance -------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("split", list(SPLITS))
def test_one_mini_batch_equals_the_formula_whatever_the_split(
    results: LayoutRuns, model_dir: Path, split: str, mode: str
) -> None:
    world = SPLITS[split][0]
    per_rank = case_results(results, world, f"{mode}-{split}")
    want = reference_update(model_dir, tiny_verl.rows(), mode)
    (first,) = case_results(results, 1, f"{mode}-dp1-mb4")
    for rank, result in enumerate(per_rank):
        assert relative(result["update"], want) <= FORMULA_RTOL, (split, mode, rank)
        assert relative(result["update"], first["update"]) <= UPDATE_RTOL, (split, mode, rank)
    for result in per_rank[1:]:
        for name, delta in per_rank[0]["update"].items():
            assert torch.equal(result["update"][name], delta), name


def test_several_mini_batches_and_epochs_train_the_same_on_one_and_two_ranks(
    results: LayoutRuns,
) -> None:
    (one,) = case_results(results, 1, "two-epochs-two-mini-batches")
    two = case_results(results, 2, "two-epochs-two-mini-batches")
    assert relative(two[0]["update"], one["update"]) <= UPDATE_RTOL
    assert one["normalizers"] == two[0]["normalizers"]
    assert not is_zero(one["update"])


def test_the_normalizers_count_active_units_over_the_data_parallel_group(
    results: LayoutRuns,
) -> None:
    """22 active tokens, 7 active responses of 8, 2 prompt groups, on either layout."""
    want_pg = {"token_mean": 22.0, "seq_mean": 7.0, "prompt_mean": 2.0, "constant": 7.0}
    for split, (world, _, _) in SPLITS.items():
        for mode, pg in want_pg.items():
            for result in case_results(results, world, f"{mode}-{split}"):
                assert result["normalizers"] == {"pg": pg, "kl": 22.0, "entropy": 22.0}


# -- verl's own modes on the same data ----------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "verl"),
    [
        ("token_mean-dp2-mb2", "verl-token-mean-dp2-mb2"),
        ("seq_mean-dense", "verl-seq-mean-dense"),
        ("constant-dense", "verl-sum-norm-dense"),
    ],
)
def test_equals_verl_where_the_two_mean_the_same(results: LayoutRuns, ours: str, verl: str) -> None:
    for got, want in zip(
        case_results(results, 2, ours), case_results(results, 2, verl), strict=True
    ):
        assert relative(got["update"], want["update"]) <= UPDATE_RTOL


@pytest.mark.parametrize(
    "pair",
    [
        ("verl-seq-mean", "seq_mean-pg", "seq_mean", None),
        ("verl-seq-sum", "constant1-pg", "constant", 1.0),
    ],
)
def test_verl_counts_a_fully_masked_response_and_lossreduce_does_not(
    results: LayoutRuns,
    model_dir: Path,
    pair: tuple[str, str, str, float | None],
) -> None:
    """seq-mean-token-mean and seq-mean-token-sum divide by verl's constant
    global_batch_size (8); one response is fully masked, so lossreduce (seq_mean, and
    constant with C = 1: token sums over active responses) divides by 7 and verl's
    update is 7/8 of it."""
    verl_case, our_case, mode, divisor = pair
    verl = case_results(results, 2, verl_case)
    ours = case_results(results, 2, our_case)
    grads = tiny_verl.reference_grads(
        model_dir, tiny_verl.rows(), mode, divisor, kl_coef=0.0, entropy_coeff=0.0
    )
    want = {n: -LR * g for n, g in grads.items()}
    for got, theirs in zip(ours, verl, strict=True):
        assert got["normalizers"] == {"pg": 7.0 * (divisor or 1.0)}
        assert relative(got["update"], want) <= FORMULA_RTOL
        scaled = {n: d * (7.0 / 8.0) for n, d in got["update"].items()}
        assert relative(theirs["update"], scaled) <= FORMULA_RTOL
        assert relative(theirs["update"], got["update"]) >= 0.12


# -- bad input ----------------------------------------------------------------------------


def test_a_rank_without_active_tokens_takes_part_and_the_other_trains(
    results: LayoutRuns, model_dir: Path
) -> None:
    batch = tiny_verl.rows()
    batch.response_mask[4:] = 0
    want = reference_update(model_dir, batch, "seq_mean")
    for result in case_results(results, 2, "rank1-masked"):
        assert result["normalizers"] == {"pg": 4.0, "kl": 14.0, "entropy": 14.0}
        assert relative(result["update"], want) <= FORMULA_RTOL


def test_an_empty_mini_batch_skipped_by_the_coordinator_leaves_weights_and_adamw_untouched(
    results: LayoutRuns,
) -> None:
    for result in case_results(results, 2, "coordinator-skip"):
        assert result["skipped_steps"] == 1
        assert is_zero(result["update"])
        # AdamW never stepped: no state, no step counter, no weight decay.
        assert result["optimizer"] == {}
        assert all(math.isfinite(v) for v in result["metrics"]["loss"])


@pytest.mark.parametrize("agg", list(VERL_MODES))
def test_verl_decays_every_weight_and_counts_a_step_on_an_empty_mini_batch(
    results: LayoutRuns, agg: str
) -> None:
    """The empty-step column of the docs' table: the loss verl reports (NaN where it
    divides by the 0 tokens it counted), a zero gradient, and an AdamW step anyway."""
    for result in case_results(results, 2, f"verl-{agg}-empty"):
        (loss,) = result["metrics"]["loss"]
        assert math.isnan(loss) if agg == "token-mean" else loss == 0.0, loss
        assert result["metrics"]["grad_norm"] == [0.0]
        assert not is_zero(result["update"])  # weight decay alone moved the weights
        steps = {float(s["step"]) for s in result["optimizer"].values()}
        assert steps == {1.0}


@pytest.mark.parametrize("agg", list(VERL_MODES))
def test_verls_modes_are_split_invariant_with_the_kl_and_entropy_on(
    results: LayoutRuns, agg: str
) -> None:
    """The split-invariance column: one rank vs two, micro-batches of 4 vs 2."""
    (one,) = case_results(results, 1, f"verl-{agg}-dp1-mb4")
    for two in case_results(results, 2, f"verl-{agg}-dp2-mb2"):
        assert relative(two["update"], one["update"]) <= UPDATE_RTOL


@pytest.mark.parametrize(
    ("world", "case", "shuffle"),
    [
        (1, "nan-advantage-dp1", False),
        (1, "nan-advantage-dp1-shuffled", True),
        (2, "nan-advantage", False),
        (2, "nan-advantage-dp2-shuffled", True),
    ],
)
def test_a_bad_row_is_named_as_the_trainer_dispatched_it(
    results: LayoutRuns, world: int, case: str, shuffle: bool
) -> None:
    """Row 6 of the batch, wherever verl's loader put it: in the second of two mini-batches
    (one rank), reordered by ``actor.shuffle``."""
    rank = world - 1
    mini_batches = 1 if case == "nan-advantage" else 2
    if shuffle:
        assert tiny_verl.shuffle_moves(6, world, mini_batches)
    culprit = case_results(results, world, case, ok=False)[rank]
    assert culprit["error"]["type"] == "InvalidPartialError", culprit.get("traceback")
    assert tiny_verl.bad_row("advantages", 6, world) in culprit["error"]["message"]


def test_a_nan_advantage_fails_every_rank_before_any_backward_naming_the_rank(
    results: LayoutRuns,
) -> None:
    culprit, peer = case_results(results, 2, "nan-advantage", ok=False)[::-1]
    assert culprit["error"]["type"] == "InvalidPartialError", culprit.get("traceback")
    assert culprit["error"]["rank"] == 1
    # Global response 6 of 8 is row 2 of rank 1's half: both are named.
    message = culprit["error"]["message"]
    assert "advantages: nan at 1 active tokens of rank 1 rows [2] (mini-batch rows [6])" in message
    assert "rank 1" in culprit["error"]["message"]
    assert peer["error"]["type"] == "RoundAbortedError", peer.get("traceback")
    assert 1 in peer["error"]["ranks"]
    for result in (culprit, peer):
        assert is_zero(result["update"])
        assert result["optimizer"] == {}


# -- backends -----------------------------------------------------------------------------


def test_the_jobs_coordinator_actor_gives_the_torch_backends_update_bit_for_bit(
    results: LayoutRuns,
) -> None:
    """No address given, so the ranks (Ray drivers of one cluster) start or join the
    job's coordinator actor, with a fresh token (the coordinator at an address is the
    contract's, test_contract.py)."""
    coordinator = case_results(results, 2, "joined-coordinator")
    torch_backend = case_results(results, 2, "prompt_mean-dp2-mb2")
    for got, want in zip(coordinator, torch_backend, strict=True):
        assert got["normalizers"] == want["normalizers"]
        for name, delta in want["update"].items():
            assert torch.equal(got["update"][name], delta), name
