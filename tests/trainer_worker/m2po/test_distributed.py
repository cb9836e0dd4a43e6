"""The global M2PO cut-off over 3 gloo ranks: torch.distributed and a real coordinator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import spawn

from lossreduce.ports import free_port
from lossreduce.trainer_worker.m2po import m2po_cutoff_in_process, m2po_cutoff_reference
from tests.trainer_worker.m2po import m2po_harness
from tests.trainer_worker.m2po.m2po_harness import EMPTY_RANK, THRESHOLD, rank_batch, union_of

ROOT = Path(__file__).resolve().parents[3]
WORLD = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from lossreduce.server import CoordinatorSettings, CoordinatorThread

    out = tmp_path_factory.mktemp("m2po")
    settings = CoordinatorSettings.model_validate(
        {"host": "127.0.0.1", "port": 0, "metrics_port": None, "round_timeout_s": 30.0}
    )
    with pytest.MonkeyPatch.context() as patch, CoordinatorThread(settings) as coord:
        patch.syspath_prepend(str(ROOT))  # spawned ranks import the harness by name
        spawn(
            m2po_harness.worker,
            args=(WORLD, free_port(), str(out), coord.target),
            nprocs=WORLD,
            join=True,
        )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("backend", ["torch", "coord"])
def test_every_rank_gets_the_reference_cut(backend: str, results: list[dict[str, Any]]) -> None:
    union = union_of(WORLD)
    cutoff, kept = m2po_cutoff_reference(union, THRESHOLD)
    assert 0 < kept < union.numel()
    in_process = m2po_cutoff_in_process(
        [m2[mask] for m2, mask in map(rank_batch, range(WORLD))], THRESHOLD
    )[0]
    for rank, res in enumerate(results):
        got = res[f"{backend}_batch"]
        assert "error" not in got, got
        # The same cut-off on every rank, as in one process; the reference's tokens.
        assert (got["cutoff"], got["kept"], got["total"]) == (
            in_process.cutoff,
            kept,
            union.numel(),
        )
        m2, mask = rank_batch(rank)
        assert torch.equal(got["keep"], mask & (m2 <= cutoff))
        assert got["rounds"] == in_process.rounds
    assert not results[EMPTY_RANK][f"{backend}_batch"]["keep"].any()
    # The rank after the invalid round is fine again: the same answer.
    assert [r[f"{backend}_after_nan"]["kept"] for r in results] == [kept] * WORLD


@pytest.mark.parametrize("backend", ["torch", "coord"])
def test_every_token_masked_is_a_result(backend: str, results: list[dict[str, Any]]) -> None:
    for res in results:
        got = res[f"{backend}_all_masked"]
        assert (got["kept"], got["cutoff"]) == (0, float("-inf")), got
        assert not got["keep"].any()


@pytest.mark.parametrize("backend", ["torch", "coord"])
def test_a_nan_raises_on_every_rank(backend: str, results: list[dict[str, Any]]) -> None:
    nan = [res[f"{backend}_nan"] for res in results]
    assert nan[1]["error"] == "InvalidPartialError", nan
    assert "m2 value nan at row 1 position 2" in nan[1]["message"]
    assert "rank 1" in nan[1]["message"]
    for rank in (0, 2):
        assert nan[rank]["error"] == "RoundAbortedError", nan[rank]
        assert (nan[rank]["ranks"], nan[rank]["rank"]) == ((1,), rank)
        assert "rank(s) [1]" in nan[rank]["message"]


@pytest.mark.parametrize("backend", ["torch", "coord"])
def test_ranks_that_disagree_on_the_threshold_raise(
    backend: str, results: list[dict[str, Any]]
) -> None:
    errors = {res[f"{backend}_mismatch"].get("error") for res in results}
    assert errors == {"ContractMismatchError"}, [r[f"{backend}_mismatch"] for r in results]
