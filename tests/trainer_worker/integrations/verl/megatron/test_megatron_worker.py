"""LossReduceTrainingWorker on verl 0.9.1's real Megatron engine, on CPU.

verl's ``TrainingWorker`` with its ``MegatronEngine`` (Megatron-Core through mbridge)
runs one PPO mini-batch per case on a tiny Qwen2, in the layouts of
:data:`megatron_runs.LAYOUTS`, and the tests read the cached results. With SGD's step the
update is minus the gradient, so the expected update comes from
:func:`tiny_verl.reference_grads`, the formulas of the reduction semantics evaluated on
the whole mini-batch in one process, without verl or Megatron. Every case has the KL
loss and the entropy bonus on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.ports import free_port
from tests.trainer_worker.integrations.verl import tiny_verl
from tests.trainer_worker.integrations.verl.megatron.megatron_runs import (
    Job,
    MegatronCase,
    run,
    save_model,
)

# The FSDP tests' modes, tolerances and reference: the same data, the same formulas.
from tests.trainer_worker.integrations.verl.test_verl_worker import (
    FORMULA_RTOL,
    MODES,
    UPDATE_RTOL,
    reference_update,
)
from tests.trainer_worker.integrations.verl.verl_runs import is_zero, relative

# split -> (layout, micro-batch size per rank, use_dynamic_bsz, modes run in it)
SPLITS: dict[str, tuple[str, int, bool, tuple[str, ...]]] = {
    "dp1-mb4": ("dp1", 4, False, tuple(MODES)),
    "dp2-mb1": ("dp2", 1, False, tuple(MODES)),
    "dp2-dyn": ("dp2", 2, True, ("token_mean", "prompt_mean")),
}
STOCK: dict[str, Any] = {"worker": "verl", "loss_agg_mode": "token-mean"}


def split_cases(layout: str) -> list[MegatronCase]:
    return [
        MegatronCase(f"{mode}-{split}", mode=mode, divisor=MODES[mode], micro=micro, dynamic=dyn)
        for split, (where, micro, dyn, modes) in SPLITS.items()
        if where == layout
        for mode in modes
    ]


def layout_cases(layout: str, target: str) -> list[MegatronCase]:
    """Every case of ``layout`` (``target``: the coordinator's address)."""
    if layout == "dp1":
        return [
            *split_cases("dp1"),
            MegatronCase("verl-token-mean-dp1", micro=4, **STOCK),
            MegatronCase("kl_cov-dp1", micro=4, loss_mode="kl_cov"),
        ]
    if layout == "dp2":
        return [
            *split_cases("dp2"),
            MegatronCase("verl-token-mean-dp2", **STOCK),
            MegatronCase("kl_cov-dp2", micro=1, loss_mode="kl_cov"),
            # The contract's cases (empty steps, NaN under the mask, the coordinator on
            # data parallelism) are in test_contract.py.
            MegatronCase("rank1-masked", mode="seq_mean", batch="rank1_masked"),
            MegatronCase("nan-advantage", mode="prompt_mean", batch="nan_advantage"),
            MegatronCase("critic-dp2", role="critic"),
            MegatronCase("verl-critic-dp2", worker="verl", role="critic"),
        ]
    # tp2, pp2: the model split over two ranks, one data-parallel rank.
    cases = [
        MegatronCase(f"token_mean-{layout}"),
        MegatronCase(f"verl-token-mean-{layout}", **STOCK),
        MegatronCase(f"coordinator-{layout}", normalizer="coordinator", coordinator=target),
    ]
    if layout == "pp2":
        cases += [
            MegatronCase("kl_cov-pp2", micro=1, loss_mode="kl_cov"),
            MegatronCase("nan-advantage-pp2", mode="prompt_mean", batch="nan_advantage"),
        ]
    return cases


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("tiny-qwen2"))


Results = Callable[[str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(
    model_dir: Path, coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> Results:
    """layout -> every rank's results of its cases (run once per module)."""
    cache: dict[str, list[dict[str, Any]]] = {}
    root = Path(__file__).resolve().parents[5]

    def get(layout: str) -> list[dict[str, Any]]:
        if layout not in cache:
            out = tmp_path_factory.mktemp(layout)
            job = Job(
                layout, layout_cases(layout, coordinator_target), str(model_dir), str(out),
                free_port(),
            )  # fmt: skip
            with pytest.MonkeyPatch.context() as patch:
                # Spawned ranks import the run module (and verl its stand-ins) by name.
                patch.syspath_prepend(str(root))
                cache[layout] = run(job)
            for rank, result in enumerate(cache[layout]):
                assert "crash" not in result, f"{layout} rank {rank}: {result['crash']}"
        return cache[layout]

    return get


def case_results(
    results: Results, layout: str, case: str, *, ok: bool = True
) -> list[dict[str, Any]]:
    per_rank = [r[case] for r in results(layout)]
    if ok:
        for rank, result in enumerate(per_rank):
            assert "init_error" not in result, f"{layout} {case} rank {rank}: {result}"
            assert "error" not in result, f"{layout} {case} rank {rank}: {result['traceback']}"
    return per_rank


def grad_norm(per_rank: list[dict[str, Any]]) -> float:
    """verl's reported gradient norm (only the rank that collects outputs reports)."""
    (norm,) = {float(r["metrics"]["grad_norm"][0]) for r in per_rank if "metrics" in r}
    return norm


# -- every mode, every split ------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "mode"), [(split, mode) for split, spec in SPLITS.items() for mode in spec[3]]
)
def test_every_mode_equals_the_formula_whatever_the_split(
    results: Results, model_dir: Path, split: str, mode: str
) -> None:
    layout = SPLITS[split][0]
    want = reference_update(model_dir, tiny_verl.rows(), mode)
    (first,) = case_results(results, "dp1", f"{mode}-dp1-mb4")
    per_rank = case_results(results, layout, f"{mode}-{split}")
    for rank, result in enumerate(per_rank):
        assert relative(result["update"], want) <= FORMULA_RTOL, (split, mode, rank)
        assert relative(result["update"], first["update"]) <= UPDATE_RTOL, (split, mode, rank)
    for result in per_rank[1:]:
        for name, delta in per_rank[0]["update"].items():
            assert torch.equal(result["update"][name], delta), name


def test_the_normalizers_count_active_units_over_the_data_parallel_group(
    results: Results,
) -> None:
    """22 active tokens, 7 active responses of 8, 2 prompt groups, in every split."""
    want_pg = {"token_mean": 22.0, "seq_mean": 7.0, "prompt_mean": 2.0, "constant": 7.0}
    for split, (layout, _, _, modes) in SPLITS.items():
        for mode in modes:
            for result in case_results(results, layout, f"{mode}-{split}"):
                assert result["normalizers"] == {"pg": want_pg[mode], "kl": 22.0, "entropy": 22.0}
                assert result["group"] == "actor"


# -- model parallelism --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_model_parallel_2_gives_data_parallel_2s_update(
    results: Results, model_dir: Path, layout: str
) -> None:
    """TP2 x DP1 (and PP2 x DP1) against DP2: the same update, the same normalizers."""
    want = reference_update(model_dir, tiny_verl.rows(), "token_mean")
    dp2 = case_results(results, "dp2", "token_mean-dp2-mb1")[0]
    for result in case_results(results, layout, f"token_mean-{layout}"):
        assert relative(result["update"], dp2["update"]) <= UPDATE_RTOL
        assert relative(result["update"], want) <= FORMULA_RTOL
        assert result["normalizers"] == dp2["normalizers"]


def test_every_pipeline_stage_takes_part_in_the_round_and_the_last_gets_the_normalizers(
    results: Results,
) -> None:
    """verl's Megatron loss runs on the last pipeline stage only; the first stage holds
    the same rows, counts them and reduces in a round of its own (``actor.pp0``), so a
    bad input stops it too, before any forward."""
    first, last = case_results(results, "pp2", "token_mean-pp2")
    assert first["group"] == "actor.pp0"
    assert last["group"] == "actor.pp1"
    assert first["normalizers"] == last["normalizers"] == {"pg": 22.0, "kl": 22.0, "entropy": 22.0}
    # Only the last stage called the loss; the stock run shows where verl calls it.
    stock_first, stock_last = case_results(results, "pp2", "verl-token-mean-pp2")
    assert stock_first["verl_counts"] == []
    assert stock_last["verl_counts"]
    for result in case_results(results, "pp2", "nan-advantage-pp2", ok=False):
        assert result["error"]["type"] == "InvalidPartialError", result.get("traceback")
        assert "advantages: nan at 1 active tokens of rank 0 rows [6]" in result["error"]["message"]
        assert is_zero(result["update"])
        assert result["optimizer"] == []


def test_tensor_parallel_ranks_reduce_in_rounds_of_their_own(results: Results) -> None:
    for rank, result in enumerate(case_results(results, "tp2", "token_mean-tp2")):
        assert result["group"] == f"actor.tp{rank}"


# -- verl's own token-mean, side by side ----------------------------------------------------


@pytest.mark.parametrize("layout", ["dp1", "dp2", "tp2", "pp2"])
def test_token_mean_is_verls_own_update_grad_norm_and_batch_num_tokens(
    results: Results, layout: str
) -> None:
    """The A/B: stock ``TrainingWorker`` with ``loss_agg_mode=token-mean`` and lossreduce's
    ``token_mean`` on the same data, SGD without clipping: the same update and gradient
    norm, and lossreduce's normalizer is verl's own ``batch_num_tokens``."""
    ours_name = "token_mean-dp1-mb4" if layout == "dp1" else f"token_mean-{layout}"
    if layout == "dp2":
        ours_name = "token_mean-dp2-mb1"
    ours = case_results(results, layout, ours_name)
    stock = case_results(results, layout, f"verl-token-mean-{layout}")
    for got, want in zip(ours, stock, strict=True):
        assert relative(got["update"], want["update"]) <= UPDATE_RTOL
    assert grad_norm(ours) == pytest.approx(grad_norm(stock), rel=UPDATE_RTOL)
    counts = {c["batch_num_tokens"] for r in stock for c in r["verl_counts"]}
    assert counts == {ours[0]["normalizers"]["pg"]}


# -- backends ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "case", "torch_case"),
    [
        ("tp2", "coordinator-tp2", "token_mean-tp2"),
        ("pp2", "coordinator-pp2", "token_mean-pp2"),
    ],
)
def test_the_coordinator_gives_the_torch_backends_update_bit_for_bit(
    results: Results, layout: str, case: str, torch_case: str
) -> None:
    """With tensor or pipeline parallelism every model-parallel position sends its own
    rounds (``actor.tp0``, ``actor.tp1``, ...): the coordinator sees each as a group of
    one data-parallel rank, never two ranks claiming rank 0 of one group."""
    for got, want in zip(
        case_results(results, layout, case),
        case_results(results, layout, torch_case),
        strict=True,
    ):
        assert got["group"] == want["group"]
        assert got["normalizers"] == want["normalizers"]
        for name, delta in want["update"].items():
            assert torch.equal(got["update"][name], delta), name


# -- bad input -----------------------------------------------------------------------------


def test_a_rank_without_active_tokens_takes_part_and_the_other_trains(
    results: Results, model_dir: Path
) -> None:
    batch = tiny_verl.rows()
    batch.response_mask[4:] = 0
    want = reference_update(model_dir, batch, "seq_mean")
    for result in case_results(results, "dp2", "rank1-masked"):
        assert result["normalizers"] == {"pg": 4.0, "kl": 14.0, "entropy": 14.0}
        assert relative(result["update"], want) <= FORMULA_RTOL


def test_a_nan_advantage_fails_every_rank_before_any_backward_naming_the_rank(
    results: Results,
) -> None:
    culprit, peer = case_results(results, "dp2", "nan-advantage", ok=False)[::-1]
    assert culprit["error"]["type"] == "InvalidPartialError", culprit.get("traceback")
    assert culprit["error"]["rank"] == 1
    message = culprit["error"]["message"]
    assert "advantages: nan at 1 active tokens of rank 1 rows [2] (mini-batch rows [6])" in message
    assert peer["error"]["type"] == "RoundAbortedError", peer.get("traceback")
    assert 1 in peer["error"]["ranks"]
    for result in (culprit, peer):
        assert is_zero(result["update"])
        assert result["optimizer"] == []


# -- the critic ---------------------------------------------------------------------------------


def test_the_critic_on_megatron_is_verls_own_token_mean(results: Results) -> None:
    """``LossReduceCriticWorker`` on verl's Megatron value model (mbridge's value head):
    stock ``value_loss`` in ``token-mean`` (SGD, no clipping), the same update and gradient
    norm, and the value term's normalizer verl's own ``batch_num_tokens``."""
    ours = case_results(results, "dp2", "critic-dp2")
    stock = case_results(results, "dp2", "verl-critic-dp2")
    for got, want in zip(ours, stock, strict=True):
        assert got["group"] == "critic"
        assert got["normalizers"] == {"vf": 22.0}
        assert relative(got["update"], want["update"]) <= UPDATE_RTOL
        assert not is_zero(got["update"])
    assert grad_norm(ours) == pytest.approx(grad_norm(stock), rel=UPDATE_RTOL)
    assert {c["batch_num_tokens"] for r in stock for c in r["verl_counts"]} == {22}


# -- a statistic over the mini-batch -----------------------------------------------------------


def test_kl_covs_statistic_is_the_same_on_one_rank_two_ranks_and_two_pipeline_stages(
    results: Results,
) -> None:
    """``kl_cov`` with ``statistics='mini_batch'`` runs a no-grad forward first; under
    pipeline parallelism its log-probabilities exist on the last stage only, which takes
    the statistic (the first stage runs the forward with it and computes no loss)."""
    (one,) = case_results(results, "dp1", "kl_cov-dp1")
    (token_mean,) = case_results(results, "dp1", "token_mean-dp1-mb4")
    assert relative(one["update"], token_mean["update"]) > 1e-3  # the penalty moved it
    assert one["metrics"]["lossreduce/stats/selected"] == [5.0]  # int(0.25 x 22) tokens
    for layout in ("dp2", "pp2"):
        for result in case_results(results, layout, f"kl_cov-{layout}"):
            assert relative(result["update"], one["update"]) <= UPDATE_RTOL, layout


# -- context parallelism ---------------------------------------------------------------------


def test_context_parallel_stops_in_megatron_cores_local_attention(model_dir: Path) -> None:
    """verl's engine builds its model with context_parallel_size=2, and Megatron-Core's
    local attention (the CPU platform's) refuses it at construction: only Transformer
    Engine's attention implements context parallelism (scripts/gpu_check.sh holds the
    GPU check)."""
    out = model_dir.parent / "cp2"
    job = Job("cp2", [MegatronCase("token_mean-cp2")], str(model_dir), str(out), free_port())
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[5]))
        per_rank = run(job)
    for result in per_rank:
        error = result["token_mean-cp2"]["init_error"]
        assert error["type"] == "AssertionError"
        assert "Context parallelism is only supported by TEDotProductAttention" in error["message"]
