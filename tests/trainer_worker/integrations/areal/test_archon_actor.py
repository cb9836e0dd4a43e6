"""LossReduceArchonPPOActor against the real AReaL 1.0.4 Archon engine on CPU (gloo).

AReaL's ``ArchonPPOActor`` (FSDP2 over its own Qwen2, ``archon:d1`` and
``archon:d2``) runs on CPU with two of its own settings
(:mod:`lossreduce.trainer_worker.cpu_standins.areal.archon`: ``sdpa``
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

from collections.abc import Callable

import pytest

from lossreduce.ports import free_port
from tests.trainer_worker.integrations.areal import actor_checks as checks
from tests.trainer_worker.integrations.areal import archon_runs, areal_runs
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.areal_runs import MODES, SEVERAL_PER_MB, Case, Job

Results = Callable[[int], RankResults]

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
def results(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """world size -> every rank's results (each world run once per module)."""
    model_dir = archon_runs.save_weights(areal_runs.save_model(tmp_path_factory.mktemp("qwen2")))

    def run(world: int) -> RankResults:
        return areal_runs.run(
            Job(
                world,
                _cases(world, coordinator_target),
                str(model_dir),
                str(tmp_path_factory.mktemp(f"archon-world{world}")),
                free_port(),
                reference=world == 1,
            )
        )

    return checks.cached_runs(run, "Archon world")


# -- the formulas, micro-batches, ranks ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_archon_gives_every_modes_formula_update(results: Results, mode: str) -> None:
    checks.formula_update(results(1)[0], mode)


@pytest.mark.parametrize("mode", MODES)
def test_archon_several_sequences_per_micro_batch_give_the_same_update(
    results: Results, mode: str
) -> None:
    checks.several_per_micro_batch(results(1)[0], mode)


@pytest.mark.parametrize("mode", MODES)
def test_archon_two_ranks_give_one_ranks_update(results: Results, mode: str) -> None:
    checks.two_ranks_give_one(results(1)[0][f"{mode}-one"], results(2), f"{mode}-one")


def test_archon_prompt_groups_cut_into_micro_batches_on_two_ranks(
    results: Results,
) -> None:
    checks.prompt_groups_cut_on_two_ranks(results(1)[0], results(2))


def test_archon_rank_without_active_tokens_still_takes_part(
    results: Results,
) -> None:
    checks.rank_without_tokens_takes_part(results(1)[0], results(2), "masked-odd")


@pytest.mark.parametrize("world", [1, 2])
def test_archon_token_mean_is_stock_archons_token_mean(results: Results, world: int) -> None:
    checks.token_mean_is_stock(results(world)[0])


# -- failures: the same on every rank, no step taken --------------------------------------------


@pytest.mark.parametrize(("mode", "normalizer", "weight"), BAD_WEIGHT_TABLE)
def test_archon_refuses_a_bad_weight_on_every_rank(
    results: Results, mode: str, normalizer: str, weight: str
) -> None:
    checks.bad_weight_refused(results(2), f"weight-{mode}-{normalizer}-{weight}", weight)


def test_archon_names_a_nan_advantage_on_every_rank(
    results: Results,
) -> None:
    checks.nan_advantage_named(results(2), "nan-advantage")


def test_archon_empty_step_raises_on_every_rank(
    results: Results,
) -> None:
    checks.empty_step_raises(results(2), "empty-raise")


def test_archon_empty_step_is_skipped_on_every_rank(
    results: Results,
) -> None:
    checks.empty_step_skipped(results(2), "empty-skip")


def test_archon_coordinator_gives_the_torch_backends_update_bit_for_bit(
    results: Results,
) -> None:
    checks.coordinator_matches_torch(results(2), "coordinator-prompt_mean", "prompt_mean-one")


# -- a teacher's distillation term, per engine --------------------------------------------------


def _active_tokens() -> int:
    return sum(
        int(areal_runs.group_rows(g)["loss_mask"].count_nonzero())
        for g in range(len(areal_runs.GROUP_SIZES))
    )


@pytest.mark.parametrize("engine", TEACHER_ENGINES)
def test_a_teacher_is_refused_outside_token_mean(results: Results, engine: str) -> None:
    for kind, message in checks.errors(results(2), f"{engine}-teacher-seq_mean"):
        assert kind == "ReductionConfigError", message
        assert "distillation" in message, message
        assert "'token_mean'" in message, message


@pytest.mark.parametrize("engine", TEACHER_ENGINES)
def test_a_teacher_in_token_mean_is_its_own_term_and_areals_update(
    results: Results, engine: str
) -> None:
    for rank in (0, 1):
        run = results(2)[rank]
        ours, stock = run[f"{engine}-teacher-token_mean"], run[f"{engine}-stock-teacher"]
        # AReaL ran its teacher term.
        assert any(k.startswith("rkl_loss") for k in stock["stats"]), sorted(stock["stats"])
        assert checks.relative(checks.update(ours), checks.update(stock), stock["initial"]) < 1e-6
        # Both terms count the step's active tokens over both ranks.
        assert ours["stats"]["lossreduce/normalizer/distill"] == _active_tokens()
        assert ours["stats"]["lossreduce/normalizer/pg"] == _active_tokens()
