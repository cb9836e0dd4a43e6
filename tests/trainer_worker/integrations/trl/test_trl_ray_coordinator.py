"""LossReduceGRPOTrainer with ``normalizer='coordinator'`` and no address, on a real Ray
cluster: the rounds go to the job's coordinator actor, which one process starts there and
the other joins, and give the torch backend's normalizers and update on the same data.

Two processes (spawned with gloo on loopback, the tiny offline setup, two micro-steps
per optimizer step, two steps), each its own Ray driver on one local Ray session (2
CPUs), each in the anonymous namespace Ray gives a driver, as processes under torchrun or
accelerate connect with ``ray.init(address=...)``: the actor's own namespace makes them meet. The refusal without Ray is in
``test_trl_options.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install 'lossreduce[trl]'")

import ray

from lossreduce.ports import free_port
from tests.ray_support import local_ray
from tests.trainer_worker.integrations.trl import tiny_grpo
from tests.trainer_worker.integrations.trl.trl_runs import Case, Layout, run

pytestmark = [
    pytest.mark.ray,
    # transformers and TRL announce their own deprecations while a trainer is built.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*experimental.*:UserWarning"),
]

LAYOUT = Layout("2x2", processes=2, per_device=3, accumulation=2, steps_per_generation=2)


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with local_ray(num_cpus=2):
        yield ray.get_runtime_context().gcs_address


def test_rounds_without_an_address_go_to_the_jobs_coordinator_actor_with_torchs_numbers(
    ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common: dict[str, Any] = {"mode": "prompt_mean", "max_steps": 2}
    cases = [
        Case(name="torch", **common),
        # The trainer's default job, trl-grpo-<run>: the run rank 0 drew names the actor.
        Case(
            name="actor",
            normalizer="coordinator",
            job="",
            ray_address=ray_address,
            **common,
        ),
    ]
    # Spawned processes import the run module by name.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[4]))
    model_dir = tiny_grpo.save_model(tmp_path / "model")
    per_rank = run(LAYOUT, cases, model_dir, tmp_path / "runs", free_port())
    for rank, results in enumerate(per_rank):
        assert "crash" not in results, f"rank {rank}: {results['crash']}"
        for case in ("torch", "actor"):
            assert "error" not in results[case], f"rank {rank}: {results[case]['traceback']}"

    # Both processes reduced under one job, through the one actor they found under it.
    (job,) = {r["actor"]["job"] for r in per_rank}
    assert job.startswith("trl-grpo-")
    (target,) = {r["actor"]["actor_target"] for r in per_rank}
    assert target.startswith("127.0.0.1:")
    for results in per_rank:
        got, want = results["actor"], results["torch"]
        assert len(got["logs"]) == len(want["logs"]) == 2
        for log, torch_log in zip(got["logs"], want["logs"], strict=True):
            # Sums of the same counts: the same normalizers, exactly.
            for term in ("pg", "kl", "entropy"):
                key = f"lossreduce/normalizer/{term}"
                assert log[key] == torch_log[key] > 0, key
            assert log["lossreduce/round_latency_s"] > 0.0
        assert max(float(u.abs().max()) for u in got["update"].values()) > 0
        # The same normalizers; only TRL's shuffle into micro-steps may reorder float sums.
        assert tiny_grpo.relative_error(got["update"], want["update"]) <= 1e-6
    for name, update in per_rank[0]["actor"]["update"].items():
        assert torch.equal(per_rank[1]["actor"]["update"][name], update), name
