"""LossReduceTrainingWorker with Ulysses sequence parallelism on verl's FSDP2 engine, on CPU.

Two gloo ranks with ``ulysses_sequence_parallel_size=2`` form one sequence-parallel
group of one data-parallel rank: both hold the whole mini-batch, and each runs half of
every packed sequence. verl's Ulysses path is GPU-only in two places, which
:mod:`lossreduce.trainer_worker.cpu_standins.verl.ulysses` stands in for: the
flash-attention call it wraps (a CPU varlen attention) and ``dist.all_to_all``, which gloo
lacks (``RuntimeError: Backend gloo does not support alltoall``; ``all_to_all_single``
moves the same chunks). That the update equals the one-process formula shows the
all-to-alls ran: attention over half a sequence would change every log-probability.

The same two ranks without sequence parallelism (data parallel 2, packed rows too) are
the SP1 side of the comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.ports import free_port
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.trainer_worker.cpu_standins.verl import launch as cpu_launch
from tests.conftest import TEST_SETTINGS
from tests.trainer_worker.integrations.verl import tiny_verl
from tests.trainer_worker.integrations.verl.test_verl_worker import (
    FORMULA_RTOL,
    UPDATE_RTOL,
    reference_update,
)
from tests.trainer_worker.integrations.verl.verl_runs import Case, relative, run


def cases(target: str) -> list[Case]:
    return [
        Case("token_mean-sp2", ulysses=2),
        Case("prompt_mean-sp2", mode="prompt_mean", micro=4, ulysses=2),
        Case("verl-token-mean-sp2", worker="verl", ulysses=2),
        Case(
            "coordinator-sp2",
            mode="prompt_mean",
            micro=4,
            ulysses=2,
            normalizer="coordinator",
            coordinator=target,
        ),
        # SP1: the same ranks as data parallel 2 (one rank per 4 rows).
        Case("token_mean-sp1", micro=1),
        Case("prompt_mean-sp1", mode="prompt_mean", micro=1),
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cpu_launch.save_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """case -> both ranks' results."""
    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    root = Path(__file__).resolve().parents[4]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.syspath_prepend(str(root))
            per_rank = run(
                2, cases(thread.target), model_dir, tmp_path_factory.mktemp("sp"), free_port()
            )
    finally:
        thread.stop()
    for rank, result in enumerate(per_rank):
        assert "crash" not in result, f"rank {rank}: {result['crash']}"
    out: dict[str, Any] = {}
    for case in cases("unused"):
        out[case.name] = [r[case.name] for r in per_rank]
        for rank, result in enumerate(out[case.name]):
            assert "error" not in result, f"{case.name} rank {rank}: {result['traceback']}"
    return out


@pytest.mark.parametrize("mode", ["token_mean", "prompt_mean"])
def test_sequence_parallel_2_gives_the_formula_and_sp1s_update(
    results: dict[str, Any], model_dir: Path, mode: str
) -> None:
    want = reference_update(model_dir, tiny_verl.rows(), mode)
    sp1 = results[f"{mode}-sp1"][0]
    for result in results[f"{mode}-sp2"]:
        assert relative(result["update"], want) <= FORMULA_RTOL
        assert relative(result["update"], sp1["update"]) <= UPDATE_RTOL


def test_the_normalizers_count_each_token_once_not_once_per_sequence_parallel_rank(
    results: dict[str, Any],
) -> None:
    """22 active tokens and 2 prompt groups, as on one rank: each sequence-parallel
    position reduces over the data-parallel ranks (here itself) in a round of its own."""
    for rank, result in enumerate(results["token_mean-sp2"]):
        assert result["normalizers"] == {"pg": 22.0, "kl": 22.0, "entropy": 22.0}
        assert result["group"] == f"actor.sp{rank}"
    for result in results["prompt_mean-sp2"]:
        assert result["normalizers"] == {"pg": 2.0, "kl": 22.0, "entropy": 22.0}
    for result in results["token_mean-sp1"]:
        assert result["normalizers"] == {"pg": 22.0, "kl": 22.0, "entropy": 22.0}
        assert result["group"] == "actor"


def test_token_mean_is_verls_own_under_sequence_parallelism(results: dict[str, Any]) -> None:
    for got, want in zip(results["token_mean-sp2"], results["verl-token-mean-sp2"], strict=True):
        assert relative(got["update"], want["update"]) <= UPDATE_RTOL


def test_the_coordinator_gives_the_torch_backends_update_bit_for_bit(
    results: dict[str, Any],
) -> None:
    """Both sequence-parallel ranks are data-parallel rank 0 of 1: through the
    coordinator they send rounds of groups ``actor.sp0`` and ``actor.sp1``, never two
    contributions of rank 0 to one group."""
    for got, want in zip(results["coordinator-sp2"], results["prompt_mean-sp2"], strict=True):
        assert got["group"] == want["group"]
        assert got["normalizers"] == want["normalizers"]
        for name, delta in want["update"].items():
            assert torch.equal(got["update"][name], delta), name
