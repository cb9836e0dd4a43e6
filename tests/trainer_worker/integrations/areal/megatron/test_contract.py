"""AReaL's Megatron row of the contract table (:mod:`tests.contract.table`): the PPO
actor (``lossreduce_actor(MegatronPPOActor)``, AReaL 1.0.4 on Megatron-Core 0.17.0 with
the CPU platform), one ``ppo_update`` per case on the FSDP row's data and cases
(:mod:`..contract_row`), on one rank and on two data-parallel ranks (layouts ``dp1`` and
``dp2`` of :mod:`.megatron_runs`): one job per layout, holding the contract's cases,
and beside the contract's columns AReaL's own checks on the same runs (as the FSDP row)."""

from __future__ import annotations

import pytest

from lossreduce.ports import free_port
from tests.contract.checks import *  # noqa: F403  (the contract's columns, run on this row)
from tests.trainer_worker.integrations.areal import actor_checks, contract_row
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.contract_row import ArealRow
from tests.trainer_worker.integrations.areal.megatron import megatron_runs

LAYOUT = {1: "dp1", 2: "dp2"}
"""world size -> the layout: two ranks are data parallel."""

TOLERANCE = 1e-5
"""The relative error allowed between updates (Megatron's float32 kernels on CPU)."""


@pytest.fixture(scope="module")
def contract(coordinator_target: str, tmp_path_factory: pytest.TempPathFactory) -> ArealRow:
    model_dir = megatron_runs.save_model(tmp_path_factory.mktemp("tiny-qwen2"))

    def run(world: int) -> RankResults:
        return megatron_runs.run(
            megatron_runs.Job(
                LAYOUT[world],
                contract_row.cases(world, coordinator_target),
                str(model_dir),
                str(tmp_path_factory.mktemp(f"contract-{LAYOUT[world]}")),
                free_port(),
            )
        )

    return ArealRow("areal-megatron", actor_checks.cached_runs(run, "Megatron contract world"))


def test_the_nan_is_named_by_its_row_and_position(contract: ArealRow) -> None:
    contract_row.nan_named_by_row_and_position(contract)


def test_the_empty_step_names_its_empty_term(contract: ArealRow) -> None:
    contract_row.empty_term_named(contract)


def test_a_rank_without_tokens_gives_one_ranks_update(contract: ArealRow) -> None:
    contract_row.rank_without_tokens_gives_one_ranks_update(contract, TOLERANCE)
