"""AReaL's rows of the contract table (:mod:`tests.contract.table`), written once for its
engines (FSDP, Megatron): the contract's cases in AReaL's harness (:mod:`.areal_runs`), a
rank's outcome from what :func:`areal_runs.measure` recorded, and what AReaL's actor says
on the same runs beside the contract's columns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.contract.table import Case, RankOutcome, outcome_of
from tests.trainer_worker.integrations.areal import actor_checks, areal_runs
from tests.trainer_worker.integrations.areal.actor_checks import RankResults
from tests.trainer_worker.integrations.areal.areal_runs import PROMPT
from tests.trainer_worker.integrations.areal.areal_runs import Case as ArealCase

__all__ = [
    "ArealRow",
    "cases",
    "empty_term_named",
    "nan_named_by_row_and_position",
    "outcome",
    "rank_without_tokens_gives_one_ranks_update",
]

ONE_RANK_MASKED_ODD = "masked-odd-one-rank"
"""The one-rank case of :data:`Case.RANK_WITHOUT_TOKENS`'s data (groups 1, 3, 5 masked)."""


def cases(world: int, target: str) -> list[ArealCase]:
    """The contract's cases on ``world`` ranks (data of :func:`areal_runs.group_rows`; the
    NaNs sit in group 1, the last rank's on one and on two ranks). The refused and skipped
    steps follow a real one (``prelude``) with AdamW, whose weight decay would move every
    weight had the step been taken."""
    refused: dict[str, Any] = {"optimizer": "adamw", "prelude": 1}
    both = [
        ArealCase(Case.CLEAN.value, mode="prompt_mean"),
        ArealCase(Case.EMPTY_RAISE.value, data="all_masked", **refused),
        ArealCase(Case.EMPTY_SKIP.value, data="all_masked", on_empty_step="skip", **refused),
        ArealCase(Case.NAN_MASKED.value, mode="prompt_mean", data="masked_nan"),
    ]
    if world == 1:
        # Not a contract case: what two ranks, one without tokens, must give (AReaL's own
        # check beside the contract, rank_without_tokens_gives_one_ranks_update).
        return [*both, ArealCase(ONE_RANK_MASKED_ODD, mode="prompt_mean", data="masked_odd")]
    return areal_runs.with_coordinator(
        [
            *both,
            ArealCase(
                Case.NAN_ACTIVE.value, mode="prompt_mean", data="nan_advantage_rank1", **refused
            ),
            ArealCase(Case.RANK_WITHOUT_TOKENS.value, mode="prompt_mean", data="masked_odd"),
            ArealCase(Case.COORDINATOR.value, mode="prompt_mean", normalizer="coordinator"),
        ],
        target,
    )


def outcome(result: dict[str, Any]) -> RankOutcome:
    """A rank's outcome from what :func:`areal_runs.measure` recorded: an
    ``InvalidPartialError`` blames its own rank, a ``RoundAbortedError`` its ``ranks``."""
    assert "init_error" not in result, result["init_error"][2]
    error = None
    if "error" in result:
        (kind, message), (rank, ranks) = result["error"], result["error_ranks"]
        error = {"type": kind, "message": message, "rank": rank, "ranks": ranks}
    initial, params = result["initial"], result["params"]
    return outcome_of(
        {
            "update": {name: params[name] - start for name, start in initial.items()},
            "normalizers": result["normalizers"],
            "skipped_steps": result["skipped_steps"],
            "error": error,
        }
    )


class ArealRow:
    """A row whose ``runs(world)`` gives every rank's results of :func:`cases` (case
    name -> what :func:`areal_runs.measure` recorded), each world run once."""

    def __init__(self, name: str, runs: Callable[[int], RankResults]) -> None:
        self.name = name
        self.runs = runs

    def outcomes(self, case: Case, world: int) -> list[RankOutcome]:
        return [outcome(rank[case.value]) for rank in self.runs(world)]


# -- AReaL's own words on the contract's runs ---------------------------------------------------


def nan_named_by_row_and_position(row: ArealRow) -> None:
    """The culprit names the input, its row and position in the rank's batch, and itself;
    its peer names it."""
    peer, culprit = row.outcomes(Case.NAN_ACTIVE, 2)
    assert f"advantages is nan at active token (row 0, position {PROMPT})" in culprit.message
    assert "rank 1" in culprit.message, culprit.message
    assert "rank 1" in peer.message, peer.message


def empty_term_named(row: ArealRow) -> None:
    """Every rank's error names the empty term and its global value."""
    for outcome in row.outcomes(Case.EMPTY_RAISE, 2):
        assert "'pg'=0.0" in outcome.message, outcome.message


def rank_without_tokens_gives_one_ranks_update(row: ArealRow, tolerance: float) -> None:
    """Two ranks, rank 1 without tokens (groups 1, 3, 5 masked), give one rank's update of
    the same data; the round's prompt-group count is rank 0's three groups."""
    one = row.runs(1)[0][ONE_RANK_MASKED_ODD]
    want = actor_checks.update(one)
    for rank, result in enumerate(row.runs(2)):
        two = result[Case.RANK_WITHOUT_TOKENS.value]
        error = actor_checks.relative(actor_checks.update(two), want, one["initial"])
        assert error < tolerance, (rank, error)
        assert two["normalizers"] == {"pg": 3.0}, (rank, two["normalizers"])
