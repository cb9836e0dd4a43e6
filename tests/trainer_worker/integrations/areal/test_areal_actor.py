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
  optimizer state bit-identical;
- a total above 2^24 stays exact, and the coordinator gives torch's update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.ports import free_port
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from tests.conftest import TEST_SETTINGS
from tests.trainer_worker.integrations.areal import areal_runs
from tests.trainer_worker.integrations.areal.areal_runs import (
    MODES,
    ONE_PER_MB,
    SEVERAL_PER_MB,
    Case,
    Job,
)

ERRORS = [
    Case(
        name, impl=impl, data=data, weight=weight, on_empty_step=empty, optimizer="adamw", prelude=1
    )
    for name, impl, data, weight, empty in [
        ("inf", "lossreduce", "base", "inf_rank1", "raise"),
        ("stock-inf", "stock", "base", "inf_rank1", "raise"),
        ("nan-advantage", "lossreduce", "nan_advantage", "count", "raise"),
        ("stock-nan-advantage", "stock", "nan_advantage", "count", "raise"),
        ("empty-raise", "lossreduce", "all_masked", "count", "raise"),
        ("empty-skip", "lossreduce", "all_masked", "count", "skip"),
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
    cases.append(Case("masked-odd", data="masked_odd", mode="prompt_mean"))
    if world == 1:
        cases += [Case(f"{mode}-several", mode=mode, max_tokens=SEVERAL_PER_MB) for mode in MODES]
        return cases
    cases.append(Case("prompt_mean-several", mode="prompt_mean", max_tokens=SEVERAL_PER_MB))
    for mode in ("token_mean", "prompt_mean"):
        cases.append(Case(f"coordinator-{mode}", mode=mode, normalizer="coordinator"))
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
def coordinator_target() -> Iterator[str]:
    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    yield thread.target
    thread.stop()


@pytest.fixture(scope="module")
def results(
    coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int], list[dict[str, Any]]]:
    """world size -> every rank's results (each world run once per module)."""
    model_dir = areal_runs.save_model(tmp_path_factory.mktemp("tiny-qwen2"))
    cache: dict[int, list[dict[str, Any]]] = {}
    root = Path(__file__).resolve().parents[4]

    def get(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            with pytest.MonkeyPatch.context() as patch:
                # Spawned ranks import the run module by name.
                patch.syspath_prepend(str(root))
                started = time.perf_counter()
                cache[world] = areal_runs.run(
                    Job(
                        world,
                        _cases(world, coordinator_target),
                        str(model_dir),
                        str(tmp_path_factory.mktemp(f"world{world}")),
                        free_port(),
                        reference=world == 1,
                        exact_sum=world == 2,
                    )
                )
                print(f"AReaL world {world}: {time.perf_counter() - started:.1f} s")
            for rank, result in enumerate(cache[world]):
                assert "crash" not in result, f"world {world} rank {rank}: {result['crash']}"
        return cache[world]

    return get


def _relative(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """|got - want| / |want - start| over all parameters: the error relative to the update."""
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float((want[n].double() - start[n].double()).pow(2).sum()) for n in want)
    assert den > 0, "the reference step did not move the weights"
    return float((num / den) ** 0.5)


def _update(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    assert "error" not in result, result["error"]
    assert result["stats"]["update_successful"] == 1.0, result["stats"]
    params: dict[str, torch.Tensor] = result["params"]
    return params


# -- the formulas, micro-batches, ranks ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_formulas_update(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    one = results(1)[0]
    reference = one["reference"][mode]["params"]
    got = _update(one[f"{mode}-one"])
    assert _relative(got, reference, one[f"{mode}-one"]["initial"]) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_several_sequences_per_micro_batch_give_the_same_update(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    one = results(1)[0]
    start = one[f"{mode}-one"]["initial"]
    assert _relative(_update(one[f"{mode}-several"]), _update(one[f"{mode}-one"]), start) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_give_one_ranks_update(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    one = results(1)[0][f"{mode}-one"]
    two = results(2)
    for rank in (0, 1):
        assert _relative(_update(two[rank][f"{mode}-one"]), _update(one), one["initial"]) < 1e-6
    # FSDP gathers the same full parameters on both ranks.
    first, second = _update(two[0][f"{mode}-one"]), _update(two[1][f"{mode}-one"])
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_prompt_groups_cut_into_micro_batches_on_two_ranks(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    one = results(1)[0]["prompt_mean-one"]
    got = _update(results(2)[0]["prompt_mean-several"])
    assert _relative(got, _update(one), one["initial"]) < 1e-6


def test_a_rank_without_active_tokens_still_takes_part(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    # Groups 1, 3, 5 are all masked: rank 1 of two has nothing to train on.
    one = results(1)[0]["masked-odd"]
    for rank in (0, 1):
        got = _update(results(2)[rank]["masked-odd"])
        assert _relative(got, _update(one), one["initial"]) < 1e-6


@pytest.mark.parametrize("world", [1, 2])
def test_token_mean_is_areals_own_token_mean(
    results: Callable[[int], list[dict[str, Any]]], world: int
) -> None:
    run = results(world)[0]
    stock = _update(run["stock-one"])
    assert _relative(_update(run["token_mean-one"]), stock, run["stock-one"]["initial"]) < 1e-6


# -- failures: the same on every rank, no step taken --------------------------------------------


def _errors(results: Callable[[int], list[dict[str, Any]]], case: str) -> list[tuple[str, str]]:
    per_rank = [r[case] for r in results(2)]
    for result in per_rank:
        assert result["untouched"], f"{case}: weights or optimizer state changed"
    return [r.get("error", ("", "")) for r in per_rank]


def test_inf_on_one_rank_is_named_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    (kind0, msg0), (kind1, msg1) = _errors(results, "inf")
    assert kind1 == "InvalidPartialError"
    assert "rank 1" in msg1, msg1
    assert "loss_weight_fn gives inf" in msg1, msg1
    assert "'pg'=inf" in msg1, msg1
    assert kind0 == "RoundAbortedError"
    assert "rank 1" in msg0, msg0
    assert "'pg'=inf" in msg0, msg0


@pytest.mark.parametrize(("mode", "normalizer", "weight"), BAD_WEIGHT_TABLE)
def test_a_bad_weight_is_refused_in_every_mode_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]], mode: str, normalizer: str, weight: str
) -> None:
    (kind0, msg0), (kind1, msg1) = _errors(results, f"weight-{mode}-{normalizer}-{weight}")
    # Rank 1's weight for its shard (groups 1, 3, 5) and what its loss mask counts.
    count = sum(
        int(areal_runs.group_rows(g)["loss_mask"].count_nonzero()) for g in areal_runs.SHARDS[2][1]
    )
    value = float(areal_runs.BAD_WEIGHTS[weight](torch.tensor(count)))
    shown = "nan" if math.isnan(value) else repr(value)
    assert kind1 == "InvalidPartialError", msg1
    assert f"job 'areal-weight-{mode}-{normalizer}-{weight}'" in msg1, msg1
    assert "step 0 rank 1" in msg1, msg1
    assert f"loss_weight_fn gives {shown} for a batch whose loss mask holds {count} " in msg1
    assert kind0 == "RoundAbortedError", msg0
    assert "rank 1" in msg0, msg0
    # The peer learns the bad value itself, or NaN for a finite weight that disagrees.
    assert f"'pg'={shown if weight != 'off_rank1' else 'nan'}" in msg0, msg0


def test_areal_skips_an_inf_weight_silently(results: Callable[[int], list[dict[str, Any]]]) -> None:
    assert _errors(results, "stock-inf") == [("", ""), ("", "")]
    for rank in (0, 1):
        assert results(2)[rank]["stock-inf"]["stats"]["update_successful"] == 0.0


def test_a_nan_advantage_is_named_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    (kind0, msg0), (kind1, msg1) = _errors(results, "nan-advantage")
    assert kind0 == "InvalidPartialError"
    assert "rank 0" in msg0
    assert "advantages is nan at active token (row 0, position 3)" in msg0
    assert kind1 == "RoundAbortedError"
    assert "rank 0" in msg1, msg1


def test_areal_skips_a_nan_advantage_silently(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    assert _errors(results, "stock-nan-advantage") == [("", ""), ("", "")]
    for rank in (0, 1):
        assert results(2)[rank]["stock-nan-advantage"]["stats"]["update_successful"] == 0.0


def test_an_empty_step_raises_on_every_rank(results: Callable[[int], list[dict[str, Any]]]) -> None:
    for kind, message in _errors(results, "empty-raise"):
        assert kind == "EmptyNormalizerError"
        assert "'pg'=0.0" in message, message


@pytest.mark.parametrize("case", ["empty-skip", "coordinator-empty-skip"])
def test_an_empty_step_is_skipped_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]], case: str
) -> None:
    assert _errors(results, case) == [("", ""), ("", "")]
    for rank in (0, 1):
        result = results(2)[rank][case]
        assert result["skipped_steps"] == 1
        assert result["stats"]["update_successful"] == 0.0
        assert result["stats"]["lossreduce/skipped"] == 1.0


def test_areal_raises_a_bare_assertion_on_an_all_masked_step(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    for kind, message in _errors(results, "stock-empty"):
        assert kind == "AssertionError"
        assert "must be positive" in message


# -- exactness and the coordinator ----------------------------------------------------------------


def test_a_total_above_2_24_stays_exact(results: Callable[[int], list[dict[str, Any]]]) -> None:
    for rank in (0, 1):
        sums = results(2)[rank]["exact-sum"]
        assert sums["lossreduce"] == 2**24 + 2
        assert sums["areal"] == 2**24  # AReaL's float32 all-reduce rounds it


@pytest.mark.parametrize("mode", ["token_mean", "prompt_mean"])
def test_the_coordinator_gives_the_torch_backends_update_bit_for_bit(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    for rank in (0, 1):
        run = results(2)[rank]
        coordinator, torch_backend = (
            _update(run[f"coordinator-{mode}"]),
            _update(run[f"{mode}-one"]),
        )
        assert all(torch.equal(coordinator[n], torch_backend[n]) for n in torch_backend)
        assert (
            run[f"coordinator-{mode}"]["stats"]["lossreduce/normalizer/pg"]
            == (run[f"{mode}-one"]["stats"]["lossreduce/normalizer/pg"])
        )


def test_one_sequence_per_micro_batch_is_what_the_exact_tests_use() -> None:
    # Every response is longer than half the padded length, so two never share
    # a micro-batch of ONE_PER_MB tokens.
    for group in range(len(areal_runs.GROUP_SIZES)):
        lengths = areal_runs.group_rows(group)["attention_mask"].sum(-1)
        assert bool((lengths > ONE_PER_MB // 2).all())
