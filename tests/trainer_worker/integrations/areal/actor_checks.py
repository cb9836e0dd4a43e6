"""The checks the actor tests share, written once for every engine (FSDP, Archon, Megatron).

Each test module runs its jobs once (:func:`cached_runs`) and hands the per-rank results
(one dict per rank, one entry per case name) to these functions; a failed check raises
``AssertionError`` naming the case.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, TypeVar

import torch

from tests.contract.table import cached_runs
from tests.trainer_worker.integrations.areal import areal_runs

__all__ = [
    "RankResults",
    "bad_weight_refused",
    "cached_runs",
    "coordinator_matches_torch",
    "empty_step_raises",
    "empty_step_skipped",
    "errors",
    "formula_update",
    "nan_advantage_named",
    "prompt_groups_cut_on_two_ranks",
    "rank_without_tokens_takes_part",
    "relative",
    "several_per_micro_batch",
    "token_mean_is_stock",
    "two_ranks_give_one",
    "update",
]

K = TypeVar("K", bound=Hashable)

RankResults = list[dict[str, Any]]
"""Every rank's results of one job: rank -> case name -> what the case measured."""

TOLERANCE = 1e-6
"""The relative error allowed against the reference update (float32 on CPU)."""


def relative(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """|got - want| / |want - start| over all parameters: the error relative to the update."""
    assert sorted(got) == sorted(want)
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float((want[n].double() - start[n].double()).pow(2).sum()) for n in want)
    assert den > 0, "the reference step did not move the weights"
    return float((num / den) ** 0.5)


def update(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters after a case's step, which must have been taken."""
    assert "init_error" not in result, result["init_error"][2]
    assert "error" not in result, result["error"]
    assert result["stats"]["update_successful"] == 1.0, result["stats"]
    params: dict[str, torch.Tensor] = result["params"]
    return params


def errors(two: RankResults, case: str) -> list[tuple[str, str]]:
    """Each rank's (exception name, message) for ``case``, ``("", "")`` for none; no rank
    may have changed its weights or optimizer state."""
    per_rank = [r[case] for r in two]
    for result in per_rank:
        assert result["untouched"], f"{case}: weights or optimizer state changed"
    return [r.get("error", ("", "")) for r in per_rank]


# -- updates ---------------------------------------------------------------------------------


def formula_update(one: dict[str, Any], mode: str, tolerance: float = TOLERANCE) -> None:
    """The ``{mode}-one`` case of a one-rank job equals the job's formula reference."""
    reference = one["reference"][mode]["params"]
    got = update(one[f"{mode}-one"])
    assert relative(got, reference, one[f"{mode}-one"]["initial"]) < tolerance


def several_per_micro_batch(one: dict[str, Any], mode: str) -> None:
    """Several sequences per micro-batch give one sequence per micro-batch's update."""
    start = one[f"{mode}-one"]["initial"]
    assert relative(update(one[f"{mode}-several"]), update(one[f"{mode}-one"]), start) < TOLERANCE


def two_ranks_give_one(
    one: dict[str, Any],
    two: RankResults,
    case: str,
    tolerance: float = TOLERANCE,
    same_on_ranks: bool = True,
) -> None:
    """Every rank of ``two`` gives the one-rank result ``one`` of ``case``; with
    ``same_on_ranks`` both ranks hold bit-identical full parameters."""
    for rank in (0, 1):
        assert relative(update(two[rank][case]), update(one), one["initial"]) < tolerance
    if same_on_ranks:
        first, second = update(two[0][case]), update(two[1][case])
        assert all(torch.equal(first[n], second[n]) for n in first)


def prompt_groups_cut_on_two_ranks(one: dict[str, Any], two: RankResults) -> None:
    """Prompt groups cut across micro-batches on two ranks give one rank's update."""
    got = update(two[0]["prompt_mean-several"])
    assert relative(got, update(one["prompt_mean-one"]), one["prompt_mean-one"]["initial"]) < (
        TOLERANCE
    )


def rank_without_tokens_takes_part(one: dict[str, Any], two: RankResults, case: str) -> None:
    """A rank whose shard is all masked (groups 1, 3, 5) still gives one rank's update."""
    two_ranks_give_one(one[case], two, case, same_on_ranks=False)


def token_mean_is_stock(run: dict[str, Any], tolerance: float = TOLERANCE) -> None:
    """``token_mean`` gives the stock actor's update."""
    stock = update(run["stock-one"])
    assert relative(update(run["token_mean-one"]), stock, run["stock-one"]["initial"]) < tolerance


def coordinator_matches_torch(two: RankResults, coordinator_case: str, torch_case: str) -> None:
    """The coordinator gives the torch backend's update and normalizer bit for bit."""
    for run in two:
        coordinator, torch_backend = update(run[coordinator_case]), update(run[torch_case])
        assert all(torch.equal(coordinator[n], torch_backend[n]) for n in torch_backend)
        assert (
            run[coordinator_case]["stats"]["lossreduce/normalizer/pg"]
            == run[torch_case]["stats"]["lossreduce/normalizer/pg"]
        )


# -- refusals --------------------------------------------------------------------------------


def bad_weight_refused(two: RankResults, case: str, weight: str) -> tuple[str, str]:
    """Rank 1's bad ``loss_weight_fn`` ``weight`` is named there and aborts rank 0's round;
    returns rank 1's (exception name, message) for further checks."""
    (kind0, msg0), (kind1, msg1) = errors(two, case)
    # Rank 1's weight for its shard (groups 1, 3, 5) and what its loss mask counts.
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
    # The peer learns the bad value itself, or NaN for a finite weight that disagrees.
    assert f"'pg'={shown if weight != 'off_rank1' else 'nan'}" in msg0, msg0
    return kind1, msg1


def nan_advantage_named(two: RankResults, case: str) -> tuple[str, str]:
    """A NaN advantage on rank 0 is named there and aborts rank 1's round; returns rank 0's
    (exception name, message)."""
    (kind0, msg0), (kind1, msg1) = errors(two, case)
    assert kind0 == "InvalidPartialError"
    assert "advantages is nan at active token (row 0, position 3)" in msg0
    assert kind1 == "RoundAbortedError"
    assert "rank 0" in msg1, msg1
    return kind0, msg0


def empty_step_raises(two: RankResults, case: str) -> None:
    """An all-masked step raises ``EmptyNormalizerError`` on every rank."""
    for kind, message in errors(two, case):
        assert kind == "EmptyNormalizerError"
        assert "'pg'=0.0" in message, message


def empty_step_skipped(two: RankResults, case: str) -> None:
    """An all-masked step with ``on_empty_step='skip'`` is skipped on every rank."""
    assert errors(two, case) == [("", ""), ("", "")]
    for run in two:
        assert run[case]["skipped_steps"] == 1
        assert run[case]["stats"]["update_successful"] == 0.0
