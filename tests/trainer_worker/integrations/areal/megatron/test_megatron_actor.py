"""``lossreduce_actor(MegatronPPOActor)`` against the real AReaL 1.0.4 Megatron engine
(Megatron-Core 0.17.0, mbridge 0.15.1) on CPU, gloo, with the CPU platform of
:mod:`lossreduce.trainer_worker.cpu_standins.megatron.platform`.

Every case is one ``ppo_update`` on a fresh actor loaded from the same weights
(:mod:`.megatron_runs`). The measured step is SGD's (taken by Adam with
``beta1 = 0`` and ``eps`` far above every gradient, since AReaL's Megatron engine
cannot build an SGD optimizer), without clipping. Measured:

- every mode's update equals the formulas of docs/reduction-semantics.md
  (recomputed row by row in plain PyTorch);
- two data-parallel ranks, and tensor parallel 2 x data parallel 1, give one rank's
  update; ``token_mean`` is AReaL's own update, grad norm and all, and each round's
  normalizer is AReaL's own count;
- a bad ``loss_weight_fn`` is refused on every rank before backward, weights and
  optimizer state untouched (a NaN advantage, an empty step, a rank without tokens and
  the coordinator's update: AReaL's Megatron row of the contract, :mod:`.test_contract`);
- a teacher's distillation term is refused outside ``token_mean``;
- context parallelism stops where Megatron-Core's local attention refuses it.

The fixture prints each layout's step time with and without lossreduce.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lossreduce.ports import free_port
from tests.trainer_worker.integrations.areal import actor_checks as checks
from tests.trainer_worker.integrations.areal import areal_runs
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.areal_runs import MODES, SEVERAL_PER_MB, Case
from tests.trainer_worker.integrations.areal.megatron import megatron_runs
from tests.trainer_worker.integrations.areal.megatron.megatron_runs import Job

Results = Callable[[str], RankResults]

TOLERANCE = 1e-5
"""The relative error allowed between updates (Megatron's float32 kernels on CPU)."""

ERRORS = [Case("inf", weight="inf_rank1", optimizer="adamw", prelude=1)]


def _cases(layout: str, target: str) -> list[Case]:
    if layout == "cp2":
        return [Case("token_mean-one")]
    cases = [Case(f"{mode}-one", mode=mode) for mode in MODES]
    cases.append(Case("stock-one", impl="stock"))
    if layout == "dp1":
        cases += [
            Case("prompt_mean-several", mode="prompt_mean", max_tokens=SEVERAL_PER_MB),
            Case("teacher-token_mean", data="teacher"),
            Case("stock-teacher", impl="stock", data="teacher"),
            Case("teacher-seq_mean", mode="seq_mean", data="teacher"),
        ]
    if layout == "dp2":
        cases += [
            Case(
                "weight-seq_mean-coordinator",
                mode="seq_mean",
                normalizer="coordinator",
                weight="negative_rank1",
            ),
            *ERRORS,
        ]
    return areal_runs.with_coordinator(cases, target)


def _step_times(layout: str, ranks: RankResults) -> None:
    """Prints the update step's cost, with and without lossreduce."""
    if "stock-one" in ranks[0]:
        ours, stock = ranks[0]["token_mean-one"], ranks[0]["stock-one"]
        print(f"{layout} step: {ours['seconds']:.3f} s, stock {stock['seconds']:.3f} s")


@pytest.fixture(scope="module")
def results(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """layout -> every rank's results (each layout run once per module)."""
    model_dir = megatron_runs.save_model(tmp_path_factory.mktemp("tiny-qwen2"))

    def run(layout: str) -> RankResults:
        return megatron_runs.run(
            Job(
                layout,
                _cases(layout, coordinator_target),
                str(model_dir),
                str(tmp_path_factory.mktemp(layout)),
                free_port(),
                reference=layout == "dp1",
            )
        )

    return checks.cached_runs(run, "Megatron", _step_times)


# -- the formulas, ranks, tensor parallelism -----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_formulas_update(results: Results, mode: str) -> None:
    checks.formula_update(results("dp1")[0], mode, TOLERANCE)


@pytest.mark.parametrize("mode", MODES)
def test_two_data_parallel_ranks_give_one_ranks_update(results: Results, mode: str) -> None:
    one = results("dp1")[0][f"{mode}-one"]
    checks.two_ranks_give_one(one, results("dp2"), f"{mode}-one", TOLERANCE, same_on_ranks=False)


@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_2_gives_data_parallel_2s_update(results: Results, mode: str) -> None:
    two = results("dp2")[0][f"{mode}-one"]
    checks.two_ranks_give_one(two, results("tp2"), f"{mode}-one", TOLERANCE, same_on_ranks=False)


def test_prompt_groups_cut_into_packed_micro_batches(results: Results) -> None:
    one = results("dp1")[0]
    got = checks.update(one["prompt_mean-several"])
    assert (
        checks.relative(
            got, checks.update(one["prompt_mean-one"]), one["prompt_mean-one"]["initial"]
        )
        < TOLERANCE
    )


# -- the A/B against AReaL's own token mean ---------------------------------------------------------


@pytest.mark.parametrize("layout", ["dp1", "dp2", "tp2"])
def test_token_mean_is_areals_own_update_and_grad_norm(results: Results, layout: str) -> None:
    for run in results(layout):
        ours, stock = run["token_mean-one"], run["stock-one"]
        assert (
            checks.relative(checks.update(ours), checks.update(stock), stock["initial"]) < TOLERANCE
        )
        assert ours["stats"]["grad_norm"] == pytest.approx(stock["stats"]["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("layout", ["dp1", "dp2", "tp2"])
def test_each_rounds_normalizer_is_areals_own_count(results: Results, layout: str) -> None:
    world_tokens = sum(
        int(areal_runs.group_rows(g)["loss_mask"].count_nonzero())
        for g in range(len(areal_runs.GROUP_SIZES))
    )
    runs = results(layout)
    for run in runs:
        stats = run["token_mean-one"]["stats"]
        assert stats["lossreduce/normalizer/pg"] == world_tokens
        seq = run["seq_mean-one"]["stats"]
        assert seq["lossreduce/normalizer/pg"] == sum(areal_runs.GROUP_SIZES)
    # AReaL's own counts of each data-parallel rank's shard (tensor-parallel ranks
    # share one), summed: the step's tokens and sequences.
    shards = runs if layout == "dp2" else runs[:1]
    assert sum(r["token_mean-one"]["stats"]["n_valid_tokens"] for r in shards) == world_tokens
    assert sum(r["seq_mean-one"]["stats"]["ppo_actor/n_seqs"] for r in shards) == sum(
        areal_runs.GROUP_SIZES
    )


# -- failures: the same on every rank, no step taken ------------------------------------------------


def test_inf_on_one_rank_is_named_on_every_rank(results: Results) -> None:
    (kind0, msg0), (kind1, msg1) = checks.errors(results("dp2"), "inf")
    assert kind1 == "InvalidPartialError", msg1
    assert "rank 1" in msg1
    assert "'pg'=inf" in msg1
    assert kind0 == "RoundAbortedError", msg0
    assert "rank 1" in msg0


def test_a_bad_weight_is_refused_through_the_coordinator(results: Results) -> None:
    (kind0, msg0), (kind1, msg1) = checks.errors(results("dp2"), "weight-seq_mean-coordinator")
    assert kind1 == "InvalidPartialError", msg1
    assert "step 0 rank 1" in msg1
    assert kind0 == "RoundAbortedError", msg0


# -- distillation -----------------------------------------------------------------------------------


def test_a_teacher_is_refused_outside_token_mean(results: Results) -> None:
    result = results("dp1")[0]["teacher-seq_mean"]
    assert result["untouched"]
    kind, message = result["error"]
    assert kind == "ReductionConfigError"
    assert "with a teacher use mode 'token_mean'" in message


def test_a_teacher_in_token_mean_is_areals_update(results: Results) -> None:
    run = results("dp1")[0]
    ours, stock = run["teacher-token_mean"], run["stock-teacher"]
    assert "lossreduce/normalizer/distill" in ours["stats"], sorted(ours["stats"])
    assert checks.relative(checks.update(ours), checks.update(stock), stock["initial"]) < TOLERANCE


# -- context parallelism ----------------------------------------------------------------------------


def test_context_parallel_stops_in_megatron_cores_local_attention(results: Results) -> None:
    for result in results("cp2"):
        kind, message, _ = result["token_mean-one"]["init_error"]
        assert kind == "AssertionError"
        assert "Context parallelism is only supported by TEDotProductAttention" in message
