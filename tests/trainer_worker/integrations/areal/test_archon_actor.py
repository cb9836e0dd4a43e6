"""LossReduceArchonPPOActor against the real AReaL 1.0.4 Archon engine on CPU (gloo).

AReaL's ``ArchonPPOActor`` (FSDP2 over its own Qwen2, ``archon:d1`` and
``archon:d2``) runs on CPU with two of its own settings
(:mod:`lossreduce.trainer_worker.integrations.areal.archon_cpu`: ``sdpa``
attention, micro-batches padded to ``max_tokens_per_mb``); nothing of AReaL is
patched. The cases are those of ``test_areal_actor.py`` (same data, same
harness, one ``ppo_update`` on a fresh actor from the same seed per case),
with Archon's parameters compared under their Hugging Face names:

- every mode's update equals the formulas of docs/reduction-semantics.md, the
  same with one or several sequences per micro-batch and on one or two ranks;
- ``token_mean`` equals stock Archon's update, on one and two ranks;
- a bad ``loss_weight_fn`` of every kind, a NaN advantage, an empty step: the
  same error on every rank (or the same skip), no step taken;
- the coordinator gives the torch backend's update bit for bit;
- a teacher's distillation term is refused outside ``token_mean``, and in
  ``token_mean`` is its own ``distill`` term giving stock AReaL's update; the
  same two teacher cases run on the FSDP actor in the same job.
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
from tests.trainer_worker.integrations.areal.areal_runs import MODES, SEVERAL_PER_MB, Case, Job

ARCHON = "archon"

# Each bad loss_weight_fn kind once, across the modes and both backends.
BAD_WEIGHT_TABLE = [
    ("token_mean", "torch", "nan_rank1"),
    ("seq_mean", "coordinator", "inf_rank1"),
    ("prompt_mean", "torch", "negative_rank1"),
    ("constant", "coordinator", "off_rank1"),
]

TEACHER_ENGINES = ("archon", "fsdp")


def _teacher_cases(engine: str) -> list[Case]:
    return [
        Case(f"{engine}-teacher-token_mean", data="teacher", engine=engine),
        Case(f"{engine}-stock-teacher", impl="stock", data="teacher", engine=engine),
        Case(f"{engine}-teacher-seq_mean", mode="seq_mean", data="teacher", engine=engine),
    ]


def _cases(world: int, target: str) -> list[Case]:
    cases = [Case(f"{mode}-one", mode=mode, engine=ARCHON) for mode in MODES]
    cases.append(Case("stock-one", impl="stock", engine=ARCHON))
    cases.append(Case("masked-odd", data="masked_odd", mode="prompt_mean", engine=ARCHON))
    if world == 1:
        cases += [
            Case(f"{mode}-several", mode=mode, max_tokens=SEVERAL_PER_MB, engine=ARCHON)
            for mode in MODES
        ]
        return cases
    cases += [
        Case("prompt_mean-several", mode="prompt_mean", max_tokens=SEVERAL_PER_MB, engine=ARCHON),
        Case(
            "coordinator-prompt_mean", mode="prompt_mean", normalizer="coordinator", engine=ARCHON
        ),
        Case("nan-advantage", data="nan_advantage", engine=ARCHON),
        Case("empty-raise", data="all_masked", engine=ARCHON),
        Case(
            "empty-skip",
            data="all_masked",
            on_empty_step="skip",
            optimizer="adamw",
            prelude=1,
            engine=ARCHON,
        ),
    ]
    cases += [
        Case(
            f"weight-{mode}-{normalizer}-{weight}",
            mode=mode,
            normalizer=normalizer,
            weight=weight,
            engine=ARCHON,
        )
        for mode, normalizer, weight in BAD_WEIGHT_TABLE
    ]
    for engine in TEACHER_ENGINES:
        cases += _teacher_cases(engine)
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
    model_dir = areal_runs.save_weights(areal_runs.save_model(tmp_path_factory.mktemp("qwen2")))
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
                        str(tmp_path_factory.mktemp(f"archon-world{world}")),
                        free_port(),
                        reference=world == 1,
                    )
                )
                print(f"Archon world {world}: {time.perf_counter() - started:.1f} s")
            for rank, result in enumerate(cache[world]):
                assert "crash" not in result, f"world {world} rank {rank}: {result['crash']}"
        return cache[world]

    return get


def _relative(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """|got - want| / |want - start| over all parameters: the error relative to the update."""
    assert sorted(got) == sorted(want)
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float((want[n].double() - start[n].double()).pow(2).sum()) for n in want)
    assert den > 0, "the reference step did not move the weights"
    return float((num / den) ** 0.5)


def _update(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    assert "error" not in result, result["error"]
    assert result["stats"]["update_successful"] == 1.0, result["stats"]
    params: dict[str, torch.Tensor] = result["params"]
    return params


def _errors(results: Callable[[int], list[dict[str, Any]]], case: str) -> list[tuple[str, str]]:
    per_rank = [r[case] for r in results(2)]
    for result in per_rank:
        assert result["untouched"], f"{case}: weights or optimizer state changed"
    return [r.get("error", ("", "")) for r in per_rank]


# -- the formulas, micro-batches, ranks ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_archon_gives_every_modes_formula_update(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    one = results(1)[0]
    reference = one["reference"][mode]["params"]
    got = _update(one[f"{mode}-one"])
    assert _relative(got, reference, one[f"{mode}-one"]["initial"]) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_archon_several_sequences_per_micro_batch_give_the_same_update(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    one = results(1)[0]
    start = one[f"{mode}-one"]["initial"]
    assert _relative(_update(one[f"{mode}-several"]), _update(one[f"{mode}-one"]), start) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_archon_two_ranks_give_one_ranks_update(
    results: Callable[[int], list[dict[str, Any]]], mode: str
) -> None:
    one = results(1)[0][f"{mode}-one"]
    two = results(2)
    for rank in (0, 1):
        assert _relative(_update(two[rank][f"{mode}-one"]), _update(one), one["initial"]) < 1e-6
    first, second = _update(two[0][f"{mode}-one"]), _update(two[1][f"{mode}-one"])
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_archon_prompt_groups_cut_into_micro_batches_on_two_ranks(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    one = results(1)[0]["prompt_mean-one"]
    got = _update(results(2)[0]["prompt_mean-several"])
    assert _relative(got, _update(one), one["initial"]) < 1e-6


def test_archon_rank_without_active_tokens_still_takes_part(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    # Groups 1, 3, 5 are all masked: rank 1 of two has nothing to train on.
    one = results(1)[0]["masked-odd"]
    for rank in (0, 1):
        got = _update(results(2)[rank]["masked-odd"])
        assert _relative(got, _update(one), one["initial"]) < 1e-6


@pytest.mark.parametrize("world", [1, 2])
def test_archon_token_mean_is_stock_archons_token_mean(
    results: Callable[[int], list[dict[str, Any]]], world: int
) -> None:
    run = results(world)[0]
    stock = _update(run["stock-one"])
    assert _relative(_update(run["token_mean-one"]), stock, run["stock-one"]["initial"]) < 1e-6


# -- failures: the same on every rank, no step taken --------------------------------------------


@pytest.mark.parametrize(("mode", "normalizer", "weight"), BAD_WEIGHT_TABLE)
def test_archon_refuses_a_bad_weight_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]], mode: str, normalizer: str, weight: str
) -> None:
    (kind0, msg0), (kind1, msg1) = _errors(results, f"weight-{mode}-{normalizer}-{weight}")
    count = sum(
        int(areal_runs.group_rows(g)["loss_mask"].count_nonzero()) for g in areal_runs.SHARDS[2][1]
    )
    value = float(areal_runs.BAD_WEIGHTS[weight](torch.tensor(count)))
    shown = "nan" if math.isnan(value) else repr(value)
    assert kind1 == "InvalidPartialError", msg1
    assert "step 0 rank 1" in msg1, msg1
    assert f"loss_weight_fn gives {shown} for a batch whose loss mask holds {count} " in msg1
    assert kind0 == "RoundAbortedError", msg0
    assert "rank 1" in msg0, msg0
    assert f"'pg'={shown if weight != 'off_rank1' else 'nan'}" in msg0, msg0


def test_archon_names_a_nan_advantage_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    (kind0, msg0), (kind1, msg1) = _errors(results, "nan-advantage")
    assert kind0 == "InvalidPartialError"
    assert "advantages is nan at active token (row 0, position 3)" in msg0
    assert kind1 == "RoundAbortedError"
    assert "rank 0" in msg1, msg1


def test_archon_empty_step_raises_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    for kind, message in _errors(results, "empty-raise"):
        assert kind == "EmptyNormalizerError"
        assert "'pg'=0.0" in message, message


def test_archon_empty_step_is_skipped_on_every_rank(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    assert _errors(results, "empty-skip") == [("", ""), ("", "")]
    for rank in (0, 1):
        result = results(2)[rank]["empty-skip"]
        assert result["skipped_steps"] == 1
        assert result["stats"]["update_successful"] == 0.0


def test_archon_coordinator_gives_the_torch_backends_update_bit_for_bit(
    results: Callable[[int], list[dict[str, Any]]],
) -> None:
    for rank in (0, 1):
        run = results(2)[rank]
        coordinator = _update(run["coordinator-prompt_mean"])
        torch_backend = _update(run["prompt_mean-one"])
        assert all(torch.equal(coordinator[n], torch_backend[n]) for n in torch_backend)
        stats = run["coordinator-prompt_mean"]["stats"]
        assert (
            stats["lossreduce/normalizer/pg"]
            == run["prompt_mean-one"]["stats"]["lossreduce/normalizer/pg"]
        )


# -- a teacher's distillation term, per engine --------------------------------------------------


def _active_tokens() -> int:
    return sum(
        int(areal_runs.group_rows(g)["loss_mask"].count_nonzero())
        for g in range(len(areal_runs.GROUP_SIZES))
    )


@pytest.mark.parametrize("engine", TEACHER_ENGINES)
def test_a_teacher_is_refused_outside_token_mean(
    results: Callable[[int], list[dict[str, Any]]], engine: str
) -> None:
    for kind, message in _errors(results, f"{engine}-teacher-seq_mean"):
        assert kind == "ReductionConfigError", message
        assert "distillation" in message, message
        assert "'token_mean'" in message, message


@pytest.mark.parametrize("engine", TEACHER_ENGINES)
def test_a_teacher_in_token_mean_is_its_own_term_and_areals_update(
    results: Callable[[int], list[dict[str, Any]]], engine: str
) -> None:
    for rank in (0, 1):
        run = results(2)[rank]
        ours, stock = run[f"{engine}-teacher-token_mean"], run[f"{engine}-stock-teacher"]
        # AReaL ran its teacher term.
        assert any(k.startswith("rkl_loss") for k in stock["stats"]), sorted(stock["stats"])
        assert _relative(_update(ours), _update(stock), stock["initial"]) < 1e-6
        # Both terms count the step's active tokens over both ranks.
        assert ours["stats"]["lossreduce/normalizer/distill"] == _active_tokens()
        assert ours["stats"]["lossreduce/normalizer/pg"] == _active_tokens()
