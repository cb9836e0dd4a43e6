"""AReaL's row of the contract table (:mod:`tests.contract.table`): the PPO actor
(``LossReduceActorMixin`` on AReaL 1.0.4's FSDP engine), one ``ppo_update`` per case on
the data of :mod:`.areal_runs` (six prompt groups of uneven size), on one and two spawned
gloo ranks: one job per world size, holding the contract's cases (:mod:`.contract_row`).

Beside the contract's columns, AReaL's own checks on the same runs: the NaN named by its
row and position, the empty term named, and two ranks, one without tokens, giving one
rank's update (the one case the one-rank job adds)."""

from __future__ import annotations

import pytest

from lossreduce.ports import free_port
from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.trainer_worker.integrations.areal import actor_checks, areal_runs, contract_row
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.contract_row import ArealRow


@pytest.fixture(scope="module")
def contract(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> ArealRow:
    model_dir = areal_runs.save_model(tmp_path_factory.mktemp("tiny-qwen2"))

    def run(world: int) -> RankResults:
        return areal_runs.run(
            areal_runs.Job(
                world,
                contract_row.cases(world, coordinator_target),
                str(model_dir),
                str(tmp_path_factory.mktemp(f"contract-world{world}")),
                free_port(),
            )
        )

    return ArealRow("areal", actor_checks.cached_runs(run, "AReaL contract world"))


def test_the_nan_is_named_by_its_row_and_position(contract: ArealRow) -> None:
    contract_row.nan_named_by_row_and_position(contract)


def test_the_empty_step_names_its_empty_term(contract: ArealRow) -> None:
    contract_row.empty_term_named(contract)


def test_a_rank_without_tokens_gives_one_ranks_update(contract: ArealRow) -> None:
    contract_row.rank_without_tokens_gives_one_ranks_update(contract, actor_checks.TOLERANCE)
