"""Token statistics over 2 gloo ranks: torch.distributed and a real coordinator, as in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import spawn

from lossreduce.ports import free_port
from lossreduce.trainer_worker.token_stats import (
    draw_keys,
    exact_sums_in_process,
    float_order_keys,
    kth_smallest_in_process,
    seed_of,
)
from tests.trainer_worker.token_stats import stats_harness
from tests.trainer_worker.token_stats.stats_harness import (
    DRAW_K,
    EMPTY_RANK,
    TOP_K,
    rank_tokens,
)

ROOT = Path(__file__).resolve().parents[3]
WORLD = 2
BACKENDS = ["torch", "coord"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from lossreduce.server import CoordinatorSettings, CoordinatorThread

    out = tmp_path_factory.mktemp("token_stats")
    settings = CoordinatorSettings.model_validate(
        {"host": "127.0.0.1", "port": 0, "metrics_port": None, "round_timeout_s": 30.0}
    )
    with pytest.MonkeyPatch.context() as patch, CoordinatorThread(settings) as coord:
        patch.syspath_prepend(str(ROOT))  # spawned ranks import the harness by name
        spawn(
            stats_harness.worker,
            args=(WORLD, free_port(), str(out), coord.target),
            nprocs=WORLD,
            join=True,
        )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def tokens() -> list[dict[str, torch.Tensor]]:
    return [rank_tokens(r) for r in range(WORLD)]


def values_of(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"adv": part["adv"], "logp": part["logp"]}


def draws() -> list[torch.Tensor]:
    seed = seed_of("s", "g", 0, "draw")
    return [draw_keys(seed, t["rows"], t["positions"]) for t in tokens()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sums_equal_the_in_process_rounds(backend: str, results: list[dict[str, Any]]) -> None:
    parts = [values_of(t) for t in tokens()]
    in_process = exact_sums_in_process(parts)[0]
    empty = [
        p if r != EMPTY_RANK else {n: v[:0] for n, v in p.items()} for r, p in enumerate(parts)
    ]
    for res in results:
        for scenario, want in (
            ("sums", in_process),
            ("sums_after_inf", in_process),
            ("sums_empty", exact_sums_in_process(empty)[0]),
        ):
            got = res[f"{backend}_{scenario}"]
            assert got.get("sums") == want, (scenario, got)
        # Five terms a round: more rounds, the same exact sums.
        few = res[f"{backend}_sums_few_terms"]["sums"]
        assert {n: (s.count, s.total) for n, s in few.items()} == {
            n: (s.count, s.total) for n, s in in_process.items()
        }
        assert few["adv"].rounds > in_process["adv"].rounds == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_value_fails_every_rank(backend: str, results: list[dict[str, Any]]) -> None:
    culprit = results[1][f"{backend}_sums_inf"]
    assert culprit["error"] == "InvalidPartialError", culprit
    assert "rank 1: NaN or infinite values ('logp': value -inf at position 3)" in culprit["message"]
    assert culprit["terms"] == ("logp",)
    peer = results[0][f"{backend}_sums_inf"]
    assert peer["error"] == "RoundAbortedError", peer
    assert (peer["ranks"], peer["rank"]) == ((1,), 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_disagree_raise_on_every_rank(
    backend: str, results: list[dict[str, Any]]
) -> None:
    for scenario in ("sums_mismatch", "kth_mismatch"):
        errors = [res[f"{backend}_{scenario}"].get("error") for res in results]
        assert errors == ["ContractMismatchError"] * WORLD, (scenario, errors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_by_covariance_equals_the_in_process_search(
    backend: str, results: list[dict[str, Any]]
) -> None:
    parts = [values_of(t) for t in tokens()]
    means = exact_sums_in_process(parts)[0]
    adv_mean, logp_mean = means["adv"].mean, means["logp"].mean
    assert adv_mean is not None
    assert logp_mean is not None
    keys = [
        float_order_keys(-(p["adv"].double() - adv_mean) * (p["logp"].double() - logp_mean))
        for p in parts
    ]
    want = kth_smallest_in_process(keys, TOP_K)[0]
    union = torch.cat(keys)
    assert want.threshold == int(torch.sort(union).values[TOP_K - 1])
    for rank, res in enumerate(results):
        got = res[f"{backend}_top_k"]
        assert (got["kth"].threshold, got["kth"].selected, got["kth"].rounds) == (
            want.threshold,
            want.selected,
            want.rounds,
        )
        assert torch.equal(got["selected"], keys[rank] <= want.threshold)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_seeded_draw_equals_the_in_process_search(
    backend: str, results: list[dict[str, Any]]
) -> None:
    keys = draws()
    want = kth_smallest_in_process(keys, DRAW_K)[0]
    assert want.threshold is not None
    assert want.selected == DRAW_K
    empty = [k if r != EMPTY_RANK else k[:0] for r, k in enumerate(keys)]
    everything = kth_smallest_in_process(empty, 10**6)[0]
    for rank, res in enumerate(results):
        for scenario in ("draw", "draw_few_terms"):
            got = res[f"{backend}_{scenario}"]["kth"]
            assert (got.threshold, got.selected, got.total) == (
                want.threshold,
                want.selected,
                sum(k.numel() for k in keys),
            )
            assert torch.equal(
                res[f"{backend}_{scenario}"]["selected"], keys[rank] <= want.threshold
            )
        assert res[f"{backend}_draw"]["kth"].rounds == want.rounds
        assert res[f"{backend}_draw_few_terms"]["kth"].rounds > want.rounds
        got = res[f"{backend}_kth_empty"]["kth"]
        assert (got.threshold, got.selected, got.rounds) == (
            everything.threshold,
            everything.selected,
            everything.rounds,
        )
        assert got.threshold == max(k.max().item() for k in empty if k.numel())
