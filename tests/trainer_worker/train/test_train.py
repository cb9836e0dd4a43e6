"""``lossreduce train`` end to end on a real local Ray cluster (2 CPUs).

One Ray session serves the whole module, and most runs share one real
coordinator on a loopback port (``--coordinator``), so a run only pays for
starting its two worker actors; ``--verify`` runs the default path with the
coordinator as a named Ray actor. Every run uses a tiny model and few steps.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
from ray.exceptions import RayActorError

from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.trainer_worker.integrations.coordinator_actor import get_coordinator_actor
from lossreduce.trainer_worker.train.cli import PROG, main
from lossreduce.trainer_worker.train.driver import RunResult, run
from lossreduce.trainer_worker.train.outputs import StepRecord
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import TrainingFailedError, worker_name
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import flag_error
from tests.ray_support import local_ray

pytestmark = pytest.mark.ray

TINY: dict[str, Any] = {
    "workers": 2,
    "prompts_per_step": 8,
    "samples_per_prompt": 4,
    "d_model": 16,
    "heads": 2,
    "layers": 1,
    "progress": False,
    "round_timeout_s": 5.0,
    "step_timeout_s": 120.0,
}


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


MODES = ["token_mean", "seq_mean", "prompt_mean", "constant"]
ROUND_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def coordinator_target() -> Iterator[str]:
    settings = CoordinatorSettings(
        host="127.0.0.1", port=0, metrics_port=None, round_timeout_s=ROUND_TIMEOUT_S
    )
    with CoordinatorThread(settings) as thread:
        yield thread.target


def tiny(out: Path, **overrides: Any) -> TrainSettings:
    return TrainSettings.model_validate({**TINY, "out": out, **overrides})


def mode_settings(out: Path, mode: str, **overrides: Any) -> TrainSettings:
    return tiny(out, mode=mode, steps=3, kl_coef=0.05, job=f"e2e-{mode}", **overrides)


@pytest.fixture(scope="module")
def mode_runs(
    coordinator_target: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, RunResult]:
    """One 3-step run per mode against the shared coordinator."""
    return {
        mode: run(
            mode_settings(
                tmp_path_factory.mktemp(mode) / "run", mode, coordinator=coordinator_target
            )
        )
        for mode in MODES
    }


def _expected_normalizer(mode: str, record: StepRecord) -> float:
    """The pg normalizer by the semantics document: tokens, active responses or groups.

    Every kept response has at least one loss token, so all are active.
    """
    return {
        "token_mean": record.tokens,
        "seq_mean": record.responses,
        "constant": record.responses,
        "prompt_mean": record.groups,
    }[mode]


@pytest.mark.parametrize("mode", MODES)
def test_end_to_end_each_mode(mode_runs: dict[str, RunResult], mode: str) -> None:
    result = mode_runs[mode]
    assert [r.step for r in result.records] == [0, 1, 2]
    for record in result.records:
        assert not record.skipped
        assert set(record.losses) == {"pg", "kl"}
        assert all(math.isfinite(v) for v in record.losses.values())
        assert record.normalizers["pg"] == _expected_normalizer(mode, record)
        assert record.normalizers["kl"] == record.tokens  # the KL term is always token_mean
        assert 0.0 <= record.reward <= 1.0
    lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert (result.out_dir / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_coordinator_and_torch_backends_give_identical_losses(
    mode_runs: dict[str, RunResult], tmp_path: Path
) -> None:
    torch_run = run(mode_settings(tmp_path / "run", "prompt_mean", normalizer="torch"))
    coord, torch_ = mode_runs["prompt_mean"].records, torch_run.records
    assert [r.losses for r in coord] == [r.losses for r in torch_]
    assert [r.normalizers for r in coord] == [r.normalizers for r in torch_]
    assert [r.reward for r in coord] == [r.reward for r in torch_]


def _round_run(target: str, job: str, step: int) -> str:
    """The run the coordinator recorded for a finished round of the workers' group."""
    with grpc.insecure_channel(target) as channel:
        key = pb.RoundKey(job=job, group="policy", step=step)
        status = pb_grpc.ReductionCoordinatorStub(channel).GetRound(
            pb.GetRoundRequest(round=key), timeout=10
        )
    return str(status.run)


def test_the_driver_draws_one_run_and_every_worker_reduces_under_it(
    coordinator_target: str, tmp_path: Path
) -> None:
    drawn = run(tiny(tmp_path / "a", steps=1, coordinator=coordinator_target))
    given = run(tiny(tmp_path / "b", steps=1, coordinator=coordinator_target, run="given-1"))
    assert re.fullmatch(r"[0-9a-f]{8}", drawn.run)
    assert given.run == "given-1"
    for result in (drawn, given):
        # The default job carries the run: two runs never share a round.
        assert result.job == f"train-{result.run}"
        assert _round_run(coordinator_target, result.job, 0) == result.run


def test_verify_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--verify",
        "--workers=2",
        "--prompts-per-step=8",
        "--samples-per-prompt=4",
        "--d-model=16",
        "--heads=2",
        "--layers=1",
        "--mode=prompt_mean",
        "--kl-coef=0.1",
        "--microbatches=3",
        "--job=verify",
        f"--out={tmp_path}",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--verify PASSED" in out
    assert "head.weight" in out  # the per-parameter table


class KillRank:
    """Kills a worker actor once the rollouts of ``step`` are in, before training."""

    def __init__(self, job: str, rank: int, step: int) -> None:
        self.job, self.rank, self.step = job, rank, step

    def on_rollout(self, step: int) -> None:
        if step != self.step:
            return
        actor = ray.get_actor(worker_name(self.job, self.rank))
        ray.kill(actor, no_restart=True)
        # ray.kill only requests the kill: wait until calls fail, so the step's
        # training certainly meets a dead rank (not one that dies half-way).
        for _ in range(600):
            try:
                ray.get(actor.where.remote(), timeout=60)
            except RayActorError:
                return
            time.sleep(0.1)
        raise AssertionError(f"rank {self.rank} still answers after ray.kill")

    def on_step(self, record: StepRecord) -> None:
        pass


@pytest.mark.timeout(120)
def test_killed_worker_fails_the_run_naming_the_rank_and_its_peer_gets_a_coordinator_error(
    tmp_path: Path, coordinator_target: str
) -> None:
    settings = tiny(
        tmp_path / "run",
        steps=4,
        round_timeout_s=ROUND_TIMEOUT_S,
        coordinator=coordinator_target,
        job="kill",
    )
    with pytest.raises(TrainingFailedError) as caught:
        run(settings, observers=[KillRank("kill", rank=1, step=1)])
    message = str(caught.value)
    assert message.startswith("step 1 (training) failed")
    assert "rank 1 on node " in message
    assert "died" in message
    # The surviving rank was released by the coordinator, not left hanging.
    assert "rank 0 on node" in message
    assert "RoundTimeoutError" in message
    assert "ranks [1]" in message
    # The steps before the failure were recorded.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1


def test_empty_steps_skip_on_every_rank(tmp_path: Path, coordinator_target: str) -> None:
    # Near-zero temperature: every group's responses are identical, the filter
    # keeps nothing, and no rank has an active token.
    settings = tiny(
        tmp_path / "run",
        steps=2,
        temperature=1e-4,
        on_empty_step="skip",
        coordinator=coordinator_target,
        job="skip",
    )
    result = run(settings)
    assert [r.skipped for r in result.records] == [True, True]
    assert all(r.tokens == 0 and r.losses == {} for r in result.records)


def test_empty_step_raises_on_every_rank_with_the_torch_backend_too(tmp_path: Path) -> None:
    settings = tiny(
        tmp_path / "run",
        steps=2,
        temperature=1e-4,
        on_empty_step="raise",
        normalizer="torch",
        job="raise",
    )
    with pytest.raises(TrainingFailedError) as caught:
        run(settings)
    message = str(caught.value)
    assert "step 0 (training) failed" in message
    assert message.count("EmptyNormalizerError") == 2  # both ranks, same error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--workers", "0"], "--workers 0: Input should be greater than or equal to 1"),
        (["--mode", "mean"], "--mode mean: must be one of token_mean, seq_mean"),
        (["--divisor", "8"], "--divisor 8 is only valid with --mode constant"),
        (["--placement", "pack"], "--placement pack: must be one of PACK, SPREAD"),
        (["--coordinator", "nohost"], "--coordinator nohost: String should match pattern"),
        (["--lr", "inf"], "--lr inf: Input should be a finite number"),
        # Ray's wait and torch.distributed's timedelta overflow on these: reject them here.
        (["--step-timeout-s", "inf"], "--step-timeout-s inf: Input should be a finite number"),
        (["--round-timeout-s", "inf"], "--round-timeout-s inf: Input should be a finite number"),
        (["--round-timeout-s", "1e300"], "--round-timeout-s 1e300: Input should be less than"),
        (["--step-timeout-s", "1e300"], "--step-timeout-s 1e300: Input should be less than"),
        (["--tls-ca", "ca.pem"], "--tls-ca ca.pem needs --coordinator"),
        (
            ["--aggregation", "node", "--normalizer", "torch"],
            "--aggregation node needs --normalizer coordinator",
        ),
        (["--aggregation", "rack"], "--aggregation rack: must be one of auto, node, off"),
        (["--steps"], "argument --steps: expected one argument"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_arguments_give_one_line_naming_flag_and_value(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in flag_error(main, argv, capsys, PROG)


def _wait_for_death(actor: Any, pid: int, who: str) -> None:
    """ray.kill only requests the kill: wait until the process ``pid`` no longer
    answers (calls fail, or a new incarnation answers with another pid)."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.pid.remote(), timeout=60) != pid:
                return
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"{who} (pid {pid}) still answers 60 s after ray.kill")


class KillCoordinator:
    """Kills the embedded coordinator actor (letting Ray restart it) before ``step``
    trains, waits for it to die, and after that step records the pid that served it."""

    def __init__(self, job: str, step: int) -> None:
        self.job, self.step = job, step
        self.pids: tuple[int, int] | None = None
        self._killed_pid = 0

    def _actor(self) -> Any:
        return get_coordinator_actor(self.job)

    def on_rollout(self, step: int) -> None:
        if step != self.step:
            return
        actor = self._actor()
        self._killed_pid = ray.get(actor.pid.remote(), timeout=60)
        ray.kill(actor, no_restart=False)
        _wait_for_death(actor, self._killed_pid, "the coordinator actor")

    def on_step(self, record: StepRecord) -> None:
        if record.step == self.step:
            # The step trained, so a coordinator answered it: a new incarnation.
            self.pids = (self._killed_pid, ray.get(self._actor().pid.remote(), timeout=60))


@pytest.mark.timeout(180)
def test_ray_restarts_a_dead_coordinator_actor_and_training_continues(tmp_path: Path) -> None:
    settings = tiny(tmp_path / "run", steps=3, job="restart")
    killer = KillCoordinator("restart", step=1)
    result = run(settings, observers=[killer])
    # Same address after the restart: the workers' retries reached it and every step trained.
    assert [(r.step, r.skipped) for r in result.records] == [(0, False), (1, False), (2, False)]
    assert killer.pids is not None, "the kill never happened"
    before, after = killer.pids
    assert after != before, f"step 1 was served by the killed process {before}: no restart"


@pytest.mark.timeout(300)
def test_joins_an_existing_cluster_and_leaves_it_running(tmp_path: Path) -> None:
    # This module's session is the "existing cluster"; the CLI runs as another driver.
    address = ray.get_runtime_context().gcs_address
    argv = [
        sys.executable,
        "-m",
        "lossreduce.cli",
        "train",
        f"--address={address}",
        "--steps=2",
        "--prompts-per-step=8",
        "--samples-per-prompt=4",
        "--d-model=16",
        "--heads=2",
        "--layers=1",
        "--job=joined",
        "--no-progress",
        f"--out={tmp_path}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    # The run shut down only its own driver: the cluster it joined still serves.
    assert ray.cluster_resources().get("CPU") == 2.0
    assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60) == 42
