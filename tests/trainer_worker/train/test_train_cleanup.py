"""The driver's cleanup: a coordinator actor that died or never started ends the
run with :class:`TrainingFailedError` naming it, never with Ray's own error raised
over it from the cleanup, and the run leaves no actor or placement group behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from pydantic import SecretStr
from ray.util.placement_group import placement_group_table

from lossreduce.trainer_worker.integrations.coordinator_actor import (
    CoordinatorHandle,
    start_coordinator_actor,
)
from lossreduce.trainer_worker.train import driver
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import TrainingFailedError
from tests.ray_support import local_ray

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


def test_stopping_a_dead_coordinator_actor_does_not_raise_and_removes_its_journal() -> None:
    handle = start_coordinator_actor("cleanup-dead", 5.0, SecretStr("x" * 32))
    handle.wait_ready(120)
    assert handle.journal is not None
    ray.kill(handle.actor, no_restart=True)
    handle.stop()
    assert not handle.journal.exists()


def test_a_coordinator_actor_that_cannot_start_fails_the_run_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bad_token(job: str, round_timeout_s: float, token: SecretStr) -> CoordinatorHandle:
        # The actor's constructor rejects a one-character token.
        return start_coordinator_actor(job, round_timeout_s, SecretStr("t"))

    monkeypatch.setattr(driver, "start_coordinator_actor", bad_token)
    settings: dict[str, Any] = {
        "workers": 1,
        "steps": 1,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "d_model": 8,
        "heads": 1,
        "layers": 1,
        "kl_coef": 0.0,
        "progress": False,
        "round_timeout_s": 2.0,
        "step_timeout_s": 60.0,
        "job": "cleanup-bad-coordinator",
        "out": tmp_path / "run",
    }
    with pytest.raises(TrainingFailedError) as caught:
        driver.run(TrainSettings.model_validate(settings))
    message = str(caught.value)
    assert "lossreduce-coordinator-cleanup-bad-coordinator did not start" in message
    assert "TokenFileError" in message
    assert ray.util.list_named_actors() == []
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_a_rerun_of_a_job_whose_driver_crashed_does_not_read_the_crashed_runs_journal() -> None:
    from lossreduce.client import ClientSettings, ReductionClient

    token = SecretStr("x" * 32)

    def step0(handle: CoordinatorHandle, pg: float) -> dict[str, float]:
        settings = ClientSettings(call_timeout_s=30, token=token)
        with ReductionClient(
            handle.target, job="rerun", group="policy", rank=0, world_size=1, settings=settings
        ) as client:
            return client.reduce(0, {"pg": pg})

    crashed = start_coordinator_actor("rerun", 5.0, token)
    crashed.wait_ready(120)
    assert step0(crashed, 3.0) == {"pg": 3.0}
    # The driver dies without its cleanup: the actor goes, its journal stays.
    ray.kill(crashed.actor, no_restart=True)
    rerun = start_coordinator_actor("rerun", 5.0, token)
    try:
        rerun.wait_ready(120)
        # A fresh run's step 0 is its own round, not a "retry" of the crashed run's.
        assert step0(rerun, 5.0) == {"pg": 5.0}
    finally:
        rerun.stop()
        assert crashed.journal is not None
        for suffix in ("", "-wal", "-shm"):
            Path(f"{crashed.journal}{suffix}").unlink(missing_ok=True)
