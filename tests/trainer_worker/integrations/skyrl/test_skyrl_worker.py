"""LossReducePolicyWorker and LossReduceCriticWorker against SkyRL 0.4's real FSDP policy
and critic workers on CPU.

SkyRL's ``FSDPPolicyWorkerBase`` (stock) and ``LossReducePolicyWorker`` each run one
policy mini-batch (``forward_backward``) per case on a tiny Qwen2, on one rank and on
two gloo ranks, with several micro-batch sizes, and the tests read the cached
gradients (taken before the optimizer step: what SGD with lr 1 and no clipping
applies). The expected gradients come from :func:`tiny_skyrl.reference_grads`, the
formulas of the reduction semantics over the whole mini-batch in one process, without
SkyRL. Every case has SkyRL's KL loss and entropy loss on unless it says otherwise.
What every framework keeps (empty mini-batches raised or skipped on every rank, bad input
refused, a NaN under the mask harmless, the coordinator's answer bit for bit) is SkyRL's
row of the contract table, ``test_contract.py``.

The critic's cases (in the same spawned runs) train SkyRL's critic instead, its value
loss against :func:`tiny_skyrl.reference_value_grads` (SkyRL's critic model with the
worker's initial weights, the formula in one process), and carry the critic's own
validation cases, as the contract's but for the value loss. The driver's z-score
(``advantage_batch_normalize``) is applied to the whole batch before it is sharded, as
``LossReduceRayPPOTrainer`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_worker.integrations.skyrl import tiny_skyrl
from tests.trainer_worker.integrations.skyrl.skyrl_runs import run
from tests.trainer_worker.integrations.skyrl.worker_cases import (
    CRITIC_LAYOUTS,
    DIVISOR,
    INVARIANCE_LAYOUTS,
    LAYOUTS,
    MODES,
    POLICY_LOSSES,
    VALUE_CLIP,
    layout_cases,
)

FORMULA_RTOL = 1e-5
"""|grad - reference| / |reference| over all parameters: float32 with SkyRL's forward
against Hugging Face's is ~2e-7 here; a wrong normalizer is off by 1/8 or more."""
SPLIT_RTOL = 1e-6
"""The same between two layouts of lossreduce's worker (float32 reordering)."""
STOCK_SPLIT_SPREAD = 0.1
"""Stock SkyRL's entropy gradient moves at least this much between micro-batch sizes."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_skyrl.save_model(tmp_path_factory.mktemp("tiny-qwen2"))


Results = Callable[[str, str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> Results:
    """(layout, case) -> every rank's result (each layout runs once per module)."""
    cache: dict[str, list[dict[str, Any]]] = {}
    root = Path(__file__).resolve().parents[4]

    def get(layout: str, case: str) -> list[dict[str, Any]]:
        if layout not in cache:
            world, micro = LAYOUTS[layout]
            with pytest.MonkeyPatch.context() as patch:
                # Spawned ranks import the run module by name.
                patch.syspath_prepend(str(root))
                cache[layout] = run(
                    world,
                    micro,
                    layout_cases(layout, coordinator_target),
                    model_dir,
                    tmp_path_factory.mktemp(layout),
                )
        return [per_rank[case] for per_rank in cache[layout]]

    return get


def ok(results: Results, layout: str, case: str) -> list[dict[str, Any]]:
    per_rank = results(layout, case)
    for rank, result in enumerate(per_rank):
        assert result["error"] is None, f"{layout} {case} rank {rank}: {result['traceback']}"
    return per_rank


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """|got - want| / |want| over all parameters."""
    assert sorted(got) == sorted(want)
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float(want[n].double().pow(2).sum()) for n in want)
    assert den > 0, "the reference gradient is zero"
    return math.sqrt(num / den)


def grads(results: Results, layout: str, case: str) -> dict[str, torch.Tensor]:
    """Rank 0's gradients (every rank holds the same full gradient)."""
    per_rank = ok(results, layout, case)
    for other in per_rank[1:]:
        for name, grad in per_rank[0]["grads"].items():
            assert torch.equal(other["grads"][name], grad), (layout, case, name)
    return per_rank[0]["grads"]  # type: ignore[no-any-return]


# -- the entropy and KL terms: stock SkyRL against lossreduce --------------------------


def test_stock_skyrls_entropy_gradient_depends_on_the_micro_batch_split(results: Results) -> None:
    """SkyRL's entropy term is a token mean per micro-batch, weighted by the micro-batch's
    share of rows: its gradient moves with the micro-batch size."""
    whole = grads(results, "dp1-mb8", "stock-entropy")
    moved = {
        layout: relative(grads(results, layout, "stock-entropy"), whole)
        for layout in ("dp1-mb4", "dp1-mb2", "dp1-mb1", "dp2-mb2")
    }
    assert max(moved.values()) > STOCK_SPLIT_SPREAD, moved
    assert all(value > 1e-3 for value in moved.values()), moved


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lossreduces_entropy_gradient_is_the_formula_whatever_the_split(
    results: Results, model_dir: Path, layout: str
) -> None:
    batch = tiny_skyrl.with_advantages(
        tiny_skyrl.rows(), torch.zeros_like(tiny_skyrl.rows().advantages)
    )
    want = tiny_skyrl.reference_grads(model_dir, batch, tiny_skyrl.Terms(pg=False, kl=False))
    assert relative(grads(results, layout, "entropy"), want) <= FORMULA_RTOL
    assert relative(grads(results, layout, "entropy"), grads(results, "dp1-mb8", "entropy")) <= (
        SPLIT_RTOL
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stock_skyrls_kl_is_a_mean_over_all_responses_masked_ones_as_zero(
    results: Results, model_dir: Path, layout: str
) -> None:
    """SkyRL's KL: each response's token mean, averaged over all 8 responses (the masked
    one adds a zero). It does not depend on the split; lossreduce's ``kl_mode=seq_mean``
    averages over the 7 active responses, so SkyRL's is 7/8 of it here."""
    stock = grads(results, layout, "stock-kl")
    seq = grads(results, layout, "kl-seq_mean")
    assert relative({n: g * 8 / 7 for n, g in stock.items()}, seq) <= FORMULA_RTOL
    batch = tiny_skyrl.with_advantages(
        tiny_skyrl.rows(), torch.zeros_like(tiny_skyrl.rows().advantages)
    )
    want = tiny_skyrl.reference_grads(
        model_dir, batch, tiny_skyrl.Terms(pg=False, entropy=False, kl_mode="seq_mean")
    )
    assert relative(seq, want) <= FORMULA_RTOL


# -- every mode against the formula, on 1 and 2 ranks and every micro-batch size -------


@pytest.mark.parametrize("mode", [*MODES, "mixed-modes"])
@pytest.mark.parametrize("layout", INVARIANCE_LAYOUTS)
def test_every_mode_gives_the_formula_whatever_the_split(
    results: Results, model_dir: Path, layout: str, mode: str
) -> None:
    if mode == "mixed-modes":
        case = "mixed-modes"
        terms = tiny_skyrl.Terms(
            mode="seq_mean", kl_mode="constant", entropy_mode="prompt_mean", divisor=DIVISOR
        )
    else:
        case = f"all-{mode}"
        terms = tiny_skyrl.Terms(mode=mode, divisor=MODES[mode])
    want = tiny_skyrl.reference_grads(model_dir, tiny_skyrl.rows(), terms)
    got = grads(results, layout, case)
    assert relative(got, want) <= FORMULA_RTOL
    assert relative(got, grads(results, "dp1-mb8", case)) <= SPLIT_RTOL


@pytest.mark.parametrize("layout", INVARIANCE_LAYOUTS)
def test_token_based_micro_batches_give_the_formula(
    results: Results, model_dir: Path, layout: str
) -> None:
    """SkyRL's ``max_tokens_per_microbatch`` packs rows out of order (and pads ranks with
    empty micro-batches): the same update."""
    want = tiny_skyrl.reference_grads(
        model_dir, tiny_skyrl.rows(), tiny_skyrl.Terms(mode="prompt_mean")
    )
    assert relative(grads(results, layout, "token-budget"), want) <= FORMULA_RTOL


# -- the normalizers are SkyRL's own counts --------------------------------------------


def test_the_token_mean_normalizer_is_skyrls_own_count(results: Results) -> None:
    """SkyRL divides the mini-batch's advantages by its loss-mask sum; lossreduce's
    ``pg`` normalizer in ``token_mean`` is that number, reduced over the ranks."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        apply_loss_reduction_to_advantages_minibatch,
    )

    batch = tiny_skyrl.rows()
    scaled = apply_loss_reduction_to_advantages_minibatch(
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        loss_reduction="token_mean",
        micro_batch_size=1,
        max_seq_len=6,
        prompt_boundaries=None,
    )
    active = batch.loss_mask.bool() & (batch.advantages != 0)
    skyrls = float((batch.advantages[active] / scaled[active]).mean())
    for layout in ("dp1-mb8", "dp2-mb2"):
        for rank in ok(results, layout, "pg"):
            assert rank["normalizers"] == {"pg": skyrls}
    assert skyrls == float(batch.loss_mask.sum())


def test_seq_mean_counts_active_responses_where_skyrl_counts_all(results: Results) -> None:
    """SkyRL's ``sequence_mean`` divides by the mini-batch's 8 responses, the fully masked
    one too; lossreduce's ``seq_mean`` by the 7 active ones."""
    for rank in ok(results, "dp2-mb2", "seq_mean-counts"):
        assert rank["normalizers"] == {"pg": 7.0}
    tokens = float(tiny_skyrl.rows().loss_mask.sum())
    for rank in ok(results, "dp2-mb2", "all-prompt_mean"):
        assert rank["normalizers"]["pg"] == 3.0  # 3 prompt groups, SkyRL's prompt count too
        assert rank["normalizers"]["kl"] == rank["normalizers"]["entropy"] == tokens


# -- A/B against stock SkyRL ------------------------------------------------------------


def test_token_mean_is_skyrls_own_update_under_sgd(results: Results) -> None:
    """SGD (lr 1) without clipping: the policy loss's update equals stock SkyRL's."""
    stock = ok(results, "dp2-mb2", "stock-ab")[0]["update"]
    ours = ok(results, "dp2-mb2", "ab")[0]["update"]
    assert relative(ours, stock) <= 1e-6
    for layout in ("dp1-mb8", "dp1-mb1", "dp2-mb1"):
        assert relative(grads(results, layout, "pg"), grads(results, layout, "stock-pg")) <= 1e-6


def test_with_every_response_active_skyrls_kl_is_lossreduces_seq_mean_kl(
    results: Results,
) -> None:
    """No masked response: SkyRL's KL (a mean over all responses) is lossreduce's
    ``kl_mode=seq_mean``, so the policy loss and the KL loss together update as stock
    SkyRL's do (SGD, no clipping)."""
    stock = ok(results, "dp2-mb2", "stock-ab-dense")[0]["update"]
    ours = ok(results, "dp2-mb2", "ab-dense-seq-kl")[0]["update"]
    assert relative(ours, stock) <= 1e-6


@pytest.mark.parametrize("loss", POLICY_LOSSES)
def test_every_policy_loss_skyrl_ships_gives_skyrls_own_token_mean_update(
    results: Results, loss: str
) -> None:
    """Each of SkyRL's registered policy losses (but the refused ones) runs with lossreduce's
    normalizers and gives SkyRL's own gradient in ``token_mean`` (2 ranks, a first
    on-policy update, with the rollout's log-probabilities in the batch, which
    ``rollout_is`` needs; without the old ones for ``rollout_is`` and ``dppo``, whose
    forward SkyRL's trainer then skips)."""
    stock = grads(results, "dp2-mb2", f"stock-loss-{loss}")
    ours = grads(results, "dp2-mb2", f"lossreduce-loss-{loss}")
    assert relative(ours, stock) <= 1e-6
    assert any(bool(g.any()) for g in ours.values())


# -- the z-score (advantage_batch_normalize) over active tokens --------------------------


def test_with_the_z_score_a_nan_under_the_mask_trains_as_a_zero_there(
    results: Results, model_dir: Path
) -> None:
    """``advantage_batch_normalize``: a NaN advantage at every token of the masked response
    and at a padding token of an active one trains as the same batch with 0 there (bit for
    bit on 2 ranks), on 1 rank as on 2, and as the formula with the advantages z-scored
    over the active tokens. SkyRL's own z-score turns every advantage NaN here
    (``test_skyrl_statistics.py``)."""
    from lossreduce.trainer_worker.integrations.skyrl.plan import z_score

    nan = ok(results, "dp2-mb2", "zscore-masked-nan")[0]["update"]
    zero = ok(results, "dp2-mb2", "zscore-masked-zero")[0]["update"]
    assert sorted(nan) == sorted(zero)
    for name, delta in zero.items():
        assert torch.equal(nan[name], delta), name
    assert relative(ok(results, "dp1-mb8", "zscore-masked-nan")[0]["update"], zero) <= SPLIT_RTOL
    batch = tiny_skyrl.rows()
    scored = tiny_skyrl.with_advantages(batch, z_score(batch.advantages, batch.loss_mask))
    want = tiny_skyrl.reference_grads(model_dir, scored, tiny_skyrl.Terms())
    for layout in ("dp1-mb8", "dp2-mb2"):
        assert relative(grads(results, layout, "zscore-masked-nan"), want) <= FORMULA_RTOL


def test_with_the_z_score_a_nan_advantage_is_refused_naming_its_row_alone(
    results: Results,
) -> None:
    """With ``advantage_batch_normalize`` a NaN at one active token stays at that token
    (SkyRL's z-score would spread it to all 30): the refusal names rank 1's row 2, the
    mini-batch's row 6, and nothing else."""
    peer, owner = results("dp2-mb2", "zscore-nan-active")
    assert owner["error_type"] == "InvalidPartialError", owner["error"]
    assert (
        "advantages: nan at 1 active tokens of rank 1 rows [2] (mini-batch rows [6])"
        in owner["error"]
    )
    assert peer["error_type"] == "RoundAbortedError", peer["error"]
    assert "rank 1" in peer["error"]
    for rank in (owner, peer):
        assert "grads" not in rank  # refused before any backward


# -- bad input, empty mini-batches -----------------------------------------------------


def test_stock_skyrl_trains_on_a_nan_advantage_without_an_error(results: Results) -> None:
    """The loss and every gradient turn NaN; SkyRL's optimizer step skips a non-finite
    gradient norm with a logged warning, on each rank for itself."""
    for rank in ok(results, "dp2-mb2", "stock-nan-advantage"):
        assert math.isnan(rank["metrics"]["policy_loss"])
        assert math.isnan(float(rank["grad_norm"]))
        assert rank["optimizer_steps"] == 0


def test_stock_skyrl_steps_on_an_empty_mini_batch(results: Results) -> None:
    """SkyRL's counts are clamped to 1: a mini-batch whose responses are all masked trains
    on a zero gradient without an error, and AdamW's weight decay still moves the weights."""
    for rank in ok(results, "dp2-mb2", "stock-empty"):
        assert float(rank["grad_norm"]) == 0.0
        assert rank["optimizer_steps"] > 0
        assert any(bool(delta.any()) for delta in rank["update"].values())


def test_a_nan_advantage_is_refused_on_every_rank_before_backward(results: Results) -> None:
    owner, peer = results("dp2-mb2", "nan-advantage")[1], results("dp2-mb2", "nan-advantage")[0]
    assert owner["error_type"] == "InvalidPartialError", owner["error"]
    assert "advantages: nan at 1 active tokens of rank 1 rows [2]" in owner["error"]
    assert "(mini-batch rows [6])" in owner["error"]
    assert peer["error_type"] == "RoundAbortedError", peer["error"]
    assert "rank 1" in peer["error"]
    for rank in (owner, peer):
        assert "grads" not in rank  # refused before any backward


def test_an_inf_advantage_is_refused_on_every_rank_through_the_coordinator(
    results: Results,
) -> None:
    owner, peer = results("dp2-mb2", "inf-advantage-coordinator")
    assert owner["error_type"] == "InvalidPartialError", owner["error"]
    assert "advantages: inf at 1 active tokens of rank 0 rows [1]" in owner["error"]
    assert peer["error_type"] == "RoundAbortedError", peer["error"]
    assert "rank 0" in peer["error"]


def test_an_empty_mini_batch_is_refused_on_every_rank_through_the_coordinator(
    results: Results,
) -> None:
    """(The torch backend's refusal is the contract's, test_contract.py.)"""
    for rank in results("dp2-mb2", "empty-raise-coordinator"):
        assert rank["error_type"] == "EmptyNormalizerError", rank["error"]
        assert "pg" in rank["error"]


def test_an_empty_mini_batch_is_skipped_on_every_rank_without_an_optimizer_step(
    results: Results,
) -> None:
    _skipped_without_a_step(results, "empty-skip", "adamw-step")


# -- the critic: SkyRL's value loss as the term vf --------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", CRITIC_LAYOUTS)
def test_the_critics_value_loss_is_the_formula_whatever_the_split(
    results: Results, model_dir: Path, layout: str, mode: str
) -> None:
    """``LossReduceCriticWorker``: SkyRL's clipped value loss per token, reduced in each
    ``critic_mode`` over the mini-batch's active units, on 1 rank with 1 or 8
    micro-batches and on 2 ranks with 4 each (the reference: SkyRL's critic model with
    the worker's initial weights, the formula in one process)."""
    case = f"critic-{mode}"
    initial = ok(results, layout, case)[0]["initial"]
    want = tiny_skyrl.reference_value_grads(
        initial, model_dir, tiny_skyrl.rows(), mode=mode, divisor=MODES[mode], value_clip=VALUE_CLIP
    )
    got = grads(results, layout, case)
    assert relative(got, want) <= FORMULA_RTOL
    assert relative(got, grads(results, "dp1-mb8", case)) <= SPLIT_RTOL


def test_the_critics_normalizers_count_active_units_and_its_clip_is_skyrls(
    results: Results,
) -> None:
    """25 active tokens, 7 active responses (the masked one not counted), 3 prompt groups;
    SkyRL's value clip clips some of the tokens and not all."""
    counts = {"token_mean": 25.0, "seq_mean": 7.0, "prompt_mean": 3.0, "constant": 7.0}
    assert float(tiny_skyrl.rows().loss_mask.sum()) == counts["token_mean"]
    for layout in CRITIC_LAYOUTS:
        for mode, count in counts.items():
            for rank in ok(results, layout, f"critic-{mode}"):
                assert rank["normalizers"] == {"vf": count}, (layout, mode)
                assert rank["metrics"]["lossreduce/normalizer/vf"] == count
    clipped = ok(results, "dp1-mb8", "critic-token_mean")[0]["metrics"]["values_clipfrac"]
    assert 0.0 < clipped < 1.0


def test_the_critic_with_token_based_micro_batches_gives_the_formula(
    results: Results, model_dir: Path
) -> None:
    """``max_tokens_per_microbatch`` reorders rows and pads ranks with empty micro-batches."""
    initial = ok(results, "dp2-mb1", "critic-token-budget")[0]["initial"]
    want = tiny_skyrl.reference_value_grads(
        initial,
        model_dir,
        tiny_skyrl.rows(),
        mode="prompt_mean",
        divisor=None,
        value_clip=VALUE_CLIP,
    )
    assert relative(grads(results, "dp2-mb1", "critic-token-budget"), want) <= FORMULA_RTOL


def test_stock_skyrls_critic_counts_a_masked_response_as_a_zero(results: Results) -> None:
    """SkyRL's critic averages each response's token mean over all 8 responses, the masked
    one as 0: its update (SGD, lr 1) is 7/8 of lossreduce's ``critic_mode=seq_mean``."""
    stock = ok(results, "dp1-mb8", "stock-critic")[0]["update"]
    seq = grads(results, "dp1-mb8", "critic-seq_mean")
    assert relative(stock, {n: -g * 7 / 8 for n, g in seq.items()}) <= FORMULA_RTOL


def test_with_every_response_active_seq_mean_is_skyrls_own_critic_update(
    results: Results,
) -> None:
    """No masked response and micro-batches of one size: SkyRL's critic update (SGD, lr 1,
    2 ranks x 2 micro-batches) is lossreduce's ``critic_mode=seq_mean``."""
    stock = ok(results, "dp2-mb2", "stock-critic-ab-dense")[0]["update"]
    ours = ok(results, "dp2-mb2", "critic-ab-dense")[0]["update"]
    assert relative(ours, stock) <= 1e-6


def test_a_nan_under_the_critics_mask_does_no_harm(results: Results) -> None:
    """NaN values and returns at every token of the masked response and at a padding token
    of an active one: the same update, bit for bit, as the clean batch."""
    clean = ok(results, "dp2-mb2", "critic-sgd")
    masked = ok(results, "dp2-mb2", "critic-masked-nan")
    for want, got in zip(clean, masked, strict=True):
        assert any(bool(delta.any()) for delta in want["update"].values())
        for name, delta in want["update"].items():
            assert torch.equal(got["update"][name], delta), name
        assert got["normalizers"] == want["normalizers"] == {"vf": 25.0}


def test_a_nan_return_is_refused_on_every_critic_rank_before_backward(results: Results) -> None:
    peer, owner = results("dp2-mb2", "critic-nan-return")
    assert owner["error_type"] == "InvalidPartialError", owner["error"]
    assert (
        "returns: nan at 1 active tokens of rank 1 rows [2] (mini-batch rows [6])"
        in (owner["error"])
    )
    assert peer["error_type"] == "RoundAbortedError", peer["error"]
    assert "rank 1" in peer["error"]
    for rank in (owner, peer):
        assert "grads" not in rank  # refused before any backward
        assert not rank["grads_left"]


def test_an_empty_critic_mini_batch_is_refused_on_every_rank_through_the_coordinator(
    results: Results,
) -> None:
    for rank in results("dp2-mb2", "critic-empty-raise-coordinator"):
        assert rank["error_type"] == "EmptyNormalizerError", rank["error"]
        assert "vf" in rank["error"]
        assert "'critic'" in rank["error"]


def test_an_empty_critic_mini_batch_is_skipped_on_every_rank_without_an_optimizer_step(
    results: Results,
) -> None:
    _skipped_without_a_step(results, "critic-empty-skip", "critic-adamw-step")


def _skipped_without_a_step(results: Results, empty: str, same_step: str) -> None:
    """Case ``empty`` skipped its mini-batch on both ranks: no normalizers, no gradient,
    no optimizer step, no change; case ``same_step``, the same step not empty, does move."""
    for rank in ok(results, "dp2-mb2", empty):
        assert rank["skipped_steps"] == 1
        assert rank["normalizers"] is None
        assert rank["grad_norm"] is None
        assert rank["optimizer_steps"] == 0
        assert all(not bool(delta.any()) for delta in rank["update"].values())
        assert rank["metrics"]["lossreduce/skipped"] == 1.0
    for rank in ok(results, "dp2-mb2", same_step):
        assert rank["optimizer_steps"] > 0
        assert any(bool(delta.any()) for delta in rank["update"].values())
