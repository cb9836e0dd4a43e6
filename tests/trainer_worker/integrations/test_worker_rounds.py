"""A framework worker's rounds (``worker_rounds``) in one process, with the local backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lossreduce.errors import EmptyNormalizerError, InvalidPartialError
from lossreduce.trainer_worker.integrations.skyrl.settings import SkyRLReductionSettings
from lossreduce.trainer_worker.integrations.worker_rounds import (
    DataParallel,
    RunClaim,
    WorkerRounds,
    describe_claims,
    round_file,
    round_metrics,
)

CONTRACTS = {"pg": "sum:token_mean", "kl": "sum:token_mean"}


def rounds(**fields: Any) -> WorkerRounds:
    settings = SkyRLReductionSettings(run="r1", **fields)
    return WorkerRounds(settings, lambda: DataParallel(None, 0, 1, "policy"))


def partials(pg: float, kl: float) -> dict[str, torch.Tensor]:
    return {
        "pg": torch.tensor(pg, dtype=torch.float64),
        "kl": torch.tensor(kl, dtype=torch.float64),
    }


def test_one_rank_gets_its_own_partials_and_counts_its_rounds() -> None:
    r = rounds()
    assert r.next_step() == 0
    assert r.reduce(0, partials(3, 25), CONTRACTS, [], "pg") == {"pg": 3.0, "kl": 25.0}
    assert r.next_step() == 1
    assert r.identity() == ("r1", "skyrl-ppo-r1")


def test_bad_input_is_refused_naming_it() -> None:
    with pytest.raises(InvalidPartialError, match="advantages: nan at 1 active tokens"):
        rounds().reduce(0, partials(3, 25), CONTRACTS, ["advantages: nan at 1 active tokens"], "pg")


def test_an_empty_step_raises_or_is_skipped() -> None:
    with pytest.raises(EmptyNormalizerError):
        rounds().reduce(0, partials(0, 0), CONTRACTS, [], "pg")
    assert rounds(on_empty_step="skip").reduce(0, partials(0, 0), CONTRACTS, [], "pg") is None


def test_the_local_backend_has_nothing_to_claim() -> None:
    r = rounds()
    r.round = 7
    assert r.claim() == RunClaim("r1", "skyrl-ppo-r1", "policy", 7, took_over=False)


def test_claims_are_described_once_per_group() -> None:
    claims = [RunClaim("r1", "j", "policy", 2, False), RunClaim("r1", "j", "policy", 2, True)]
    assert describe_claims(claims) == [
        "lossreduce: run 'r1' claimed job 'j' group 'policy' from round 2, "
        "taken over from the run it resumes"
    ]


def test_round_metrics_and_files() -> None:
    assert round_metrics(4, {"pg": 3.0}, 0.5, skipped=False) == {
        "lossreduce/normalizer/pg": 3.0,
        "lossreduce/round_min": 4.0,
        "lossreduce/round_max": 4.0,
        "lossreduce/round_latency_s": 0.5,
        "lossreduce/skipped": 0.0,
    }
    assert round_file("s3://bucket/ckpt/global_step_2/policy", 1) == (
        "s3://bucket/ckpt/global_step_2/policy/lossreduce_round_rank1.json"
    )
