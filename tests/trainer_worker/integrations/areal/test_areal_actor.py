"""LossReduceFSDPPPOActor against the real AReaL 1.0.4 FSDP actor on CPU (gloo).

Every case is one ``ppo_update`` (AReaL's own, through ``PPOActor``) on a fresh
actor from the same seed; one process per rank, one or two ranks
(:mod:`tests.trainer_worker.integrations.areal.areal_runs`). Measured:

- every mode's update equals the formulas of docs/reduction-semantics.md
  (recomputed row by row in plain PyTorch, variable group sizes), and is the
  same with one or several sequences per micro-batch and on one or two ranks;
- ``token_mean`` equals AReaL's own update;
- inf on one rank, a NaN advantage, an empty step: AReaL's stock actor skips
  the step silently (or raises a bare AssertionError); the LossReduce actor
  raises the same way on every rank, or skips everywhere, weights and
  optimizer state bit-identical (a bad ``loss_weight_fn`` here; the NaN advantage,
  the empty step and a rank without tokens in AReaL's row of the contract,
  :mod:`.test_contract`);
- a total above 2^24 stays exact, and the coordinator gives torch's update (in
  ``token_mean`` here, ``prompt_mean`` in the contract's row), also the job's coordinator
  actor that the ranks (Ray drivers of one local cluster on two ranks) start or join
  without an address; outside Ray that backend asks for the address.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import ray

from lossreduce.ports import free_port
from tests.ray_support import local_ray
from tests.trainer_worker.integrations.areal import actor_checks as checks
from tests.trainer_worker.integrations.areal import areal_runs
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.areal_runs import (
    JOINED,
    MODES,
    ONE_PER_MB,
    SEVERAL_PER_MB,
    Case,
    Job,
)

Results = Callable[[int], RankResults]

ERRORS = [
    Case(
        name, impl=impl, data=data, weight=weight, on_empty_step=empty, optimizer="adamw", prelude=1
    )
    for name, impl, data, weight, empty in [
        ("inf", "lossreduce", "base", "inf_rank1", "raise"),
        ("stock-inf", "stock", "base", "inf_rank1", "raise"),
        ("stock-nan-advantage", "stock", "nan_advantage", "count", "raise"),
        ("stock-empty", "stock", "all_masked", "count", "raise"),
    ]
]

# Every mode with both backends refuses a bad loss_weight_fn on rank 1; each bad
# kind appears once per backend.
BAD_WEIGHT_TABLE = [
    ("token_mean", "torch", "nan_rank1"),
    ("seq_mean", "torch", "inf_rank1"),
    ("prompt_mean", "torch", "negative_rank1"),
    ("constant", "torch", "off_rank1"),
    ("token_mean", "coordinator", "off_rank1"),
    ("seq_mean", "coordinator", "negative_rank1"),
    ("prompt_mean", "coordinator", "inf_rank1"),
    ("constant", "coordinator", "nan_rank1"),
]
WEIGHT_ERRORS = [
    Case(f"weight-{mode}-{normalizer}-{weight}", mode=mode, normalizer=normalizer, weight=weight)
    for mode, normalizer, weight in BAD_WEIGHT_TABLE
]


def _cases(world: int, target: str) -> list[Case]:
    cases = [Case(f"{mode}-one", mode=mode) for mode in MODES]
    cases.append(Case("stock-one", impl="stock"))
    if world == 1:
        cases += [Case(f"{mode}-several", mode=mode, max_tokens=SEVERAL_PER_MB) for mode in MODES]
        # No address and no Ray cluster: refused at the first step.
        cases.append(Case("unjoined", normalizer="coordinator", coordinator=JOINED))
        return cases
    cases.append(Case("prompt_mean-several", mode="prompt_mean", max_tokens=SEVERAL_PER_MB))
    cases.append(Case("coordinator-token_mean", normalizer="coordinator"))
    # No address: the ranks, on one Ray cluster, start or join the job's coordinator actor.
    cases.append(
        Case("joined-prompt_mean", mode="prompt_mean", normalizer="coordinator", coordinator=JOINED)
    )
    cases.append(
        Case(
            "coordinator-empty-skip",
            normalizer="coordinator",
            data="all_masked",
            on_empty_step="skip",
            optimizer="adamw",
            prelude=1,
        )
    )
    cases += ERRORS + WEIGHT_ERRORS
    return areal_runs.with_coordinator(cases, target)


@pytest.fixture(scope="module")
def results(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """world size -> every rank's results (each world run once per module)."""
    model_dir = areal_runs.save_model(tmp_path_factory.mktemp("tiny-qwen2"))

    def run(world: int) -> RankResults:
        def job(ray_address: str | None = None) -> Job:
            return Job(
                world,
                _cases(world, coordinator_target),
                str(model_dir),
                str(tmp_path_factory.mktemp(f"world{world}")),
                free_port(),
                reference=world == 1,
                exact_sum=world == 2,
                ray_address=ray_address,
            )

        if world == 1:
            return areal_runs.run(job())
        # Two ranks join one local Ray cluster (the joined-coordinator case).
        with local_ray():
            return areal_runs.run(job(ray.get_runtime_context().gcs_address))

    return checks.cached_runs(run, "AReaL world")


# -- the formulas, micro-batches, ranks ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_formulas_update(results: Results, mode: str) -> None:
    checks.formula_update(results(1)[0], mode)


@pytest.mark.parametrize("mode", MODES)
def test_several_sequences_per_micro_batch_give_the_same_update(
    results: Results, mode: str
) -> None:
    checks.several_per_micro_batch(results(1)[0], mode)


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_give_one_ranks_update(results: Results, mode: str) -> None:
    # FSDP gathers the same full parameters on both ranks.
    checks.two_ranks_give_one(results(1)[0][f"{mode}-one"], results(2), f"{mode}-one")


def test_prompt_groups_cut_into_micro_batches_on_two_ranks(
    results: Results,
) -> None:
    checks.prompt_groups_cut_on_two_ranks(results(1)[0], results(2))


@pytest.mark.parametrize("world", [1, 2])
def test_token_mean_is_areals_own_token_mean(results: Results, world: int) -> None:
    checks.token_mean_is_stock(results(world)[0])


# -- failures: the same on every rank, no step taken --------------------------------------------


def test_inf_on_one_rank_is_named_on_every_rank(
    results: Results,
) -> None:
    (kind0, msg0), (kind1, msg1) = checks.errors(results(2), "inf")
    assert kind1 == "InvalidPartialError"
    assert "rank 1" in msg1, msg1
    assert "loss_weight_fn gives inf" in msg1, msg1
    assert "'pg'=inf" in msg1, msg1
    assert kind0 == "RoundAbortedError"
    assert "rank 1" in msg0, msg0
    assert "'pg'=inf" in msg0, msg0


@pytest.mark.parametrize(("mode", "normalizer", "weight"), BAD_WEIGHT_TABLE)
def test_a_bad_weight_is_refused_in_every_mode_on_every_rank(
    results: Results, mode: str, normalizer: str, weight: str
) -> None:
    case = f"weight-{mode}-{normalizer}-{weight}"
    _, msg1 = checks.bad_weight_refused(results(2), case, weight)
    assert f"job 'areal-{case}'" in msg1, msg1


def test_areal_skips_an_inf_weight_silently(results: Results) -> None:
    assert checks.errors(results(2), "stock-inf") == [("", ""), ("", "")]
    for rank in (0, 1):
        assert results(2)[rank]["stock-inf"]["stats"]["update_successful"] == 0.0


def test_areal_skips_a_nan_advantage_silently(
    results: Results,
) -> None:
    assert checks.errors(results(2), "stock-nan-advantage") == [("", ""), ("", "")]
    for rank in (0, 1):
        assert results(2)[rank]["stock-nan-advantage"]["stats"]["update_successful"] == 0.0


def test_an_empty_step_is_skipped_on_every_rank_through_the_coordinator(
    results: Results,
) -> None:
    checks.empty_step_skipped(results(2), "coordinator-empty-skip")
    for rank in (0, 1):
        assert results(2)[rank]["coordinator-empty-skip"]["stats"]["lossreduce/skipped"] == 1.0


def test_areal_raises_a_bare_assertion_on_an_all_masked_step(
    results: Results,
) -> None:
    for kind, message in checks.errors(results(2), "stock-empty"):
        assert kind == "AssertionError"
        assert "must be positive" in message


# -- exactness and the coordinator ----------------------------------------------------------------


def test_a_total_above_2_24_stays_exact(results: Results) -> None:
    for rank in (0, 1):
        sums = results(2)[rank]["exact-sum"]
        assert sums["lossreduce"] == 2**24 + 2
        assert sums["areal"] == 2**24  # AReaL's float32 all-reduce rounds it


def test_the_coordinator_gives_the_torch_backends_token_mean_bit_for_bit(
    results: Results,
) -> None:
    checks.coordinator_matches_torch(results(2), "coordinator-token_mean", "token_mean-one")


def test_without_an_address_the_ranks_reduce_through_the_jobs_coordinator_actor(
    results: Results,
) -> None:
    """``normalizer='coordinator'`` and no address: the two ranks (Ray drivers of one
    local cluster) start or join the job's coordinator actor, dial it with its fresh
    token, and get the torch backend's normalizers and update bit for bit."""
    two = results(2)
    checks.coordinator_matches_torch(two, "joined-prompt_mean", "prompt_mean-one")
    dialed = [rank["joined-prompt_mean"]["dialed"] for rank in two]
    assert dialed[0] == dialed[1], dialed
    client_target, actor_target = dialed[0]
    assert client_target == actor_target, dialed


def test_outside_ray_the_coordinator_backend_asks_for_an_address(results: Results) -> None:
    """No address and no Ray cluster: the first step stops before any forward, naming the
    job and the setting to give."""
    result = results(1)[0]["unjoined"]
    assert result["untouched"]
    kind, message = result["error"]
    assert kind == "UsageError", message
    assert "job 'areal-unjoined'" in message, message
    assert "pass coordinator=HOST:PORT (LOSSREDUCE_COORDINATOR)" in message, message


def test_one_sequence_per_micro_batch_is_what_the_exact_tests_use() -> None:
    # Every response is longer than half the padded length, so two never share
    # a micro-batch of ONE_PER_MB tokens.
    for group in range(len(areal_runs.GROUP_SIZES)):
        lengths = areal_runs.group_rows(group)["attention_mask"].sum(-1)
        assert bool((lengths > ONE_PER_MB // 2).all())
