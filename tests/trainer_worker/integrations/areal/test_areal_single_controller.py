"""``LossReducePPOTrainer`` in AReaL 1.0.4's default single-controller mode, on CPU.

``python single_controller_launch.py --config single_controller.yaml`` with no launcher
and no ``torchrun`` (``single_controller.py``): the controller's local scheduler starts
two RPC workers that build ``LossReduceFSDPPPOActor`` by its import path (gloo,
``fsdp:d2``) and a rollout worker whose vLLM launch starts the CPU rollout server
(``cpu_vllm_server.py``), then runs AReaL's trainer loop for 3 steps. The same launch
runs with ``actor.backend=archon:d2`` and Archon's CPU settings, whose workers build
``LossReduceArchonPPOActor``. The workers get
the ``LOSSREDUCE_*`` settings from the environment the scheduler gives them: the mode,
normalizer and coordinator from the controller's environment, which they inherit, and
the job name only from the actor's ``scheduling_spec`` ``env_vars``. The coordinator runs
in this process; its rounds show what the workers used.

One launch per engine, 2 to 4 minutes each on 2 cores (most of it the workers' start).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.trainer_worker.cpu_standins.areal.archon import ARCHON_CPU_OVERRIDES
from lossreduce.trainer_worker.integrations.areal.actor import ROUNDS_PER_VERSION
from tests.conftest import TEST_SETTINGS
from tests.trainer_worker.integrations.areal import single_controller, trainer_loop

STEPS = 3
BATCH = 4  # prompts per step (train_dataset.batch_size)
SAMPLES = 2  # gconfig.n_samples
WORKERS = 2  # actor.backend fsdp:d2
JOB = "areal-single-controller"
DIVISOR = 16  # constant's length budget: a contract a default setting would not give
DOCS = trainer_loop.ROOT / "docs" / "frameworks" / "areal.md"
# engine -> (the actor class its workers build, the launch's overrides)
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fsdp": ("LossReduceFSDPPPOActor", ()),
    "archon": ("LossReduceArchonPPOActor", ("actor.backend=archon:d2", *ARCHON_CPU_OVERRIDES)),
}


@dataclass
class Launch:
    engine: str
    run: single_controller.ControllerRun
    rounds: list[Any]  # every round the coordinator held, of any job


@pytest.fixture(scope="module", params=sorted(ENGINES))
def launch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launch]:
    engine: str = request.param
    folder = tmp_path_factory.mktemp(f"single-controller-{engine}")
    model = trainer_loop.save_policy(folder / "model")
    prompts = trainer_loop.save_prompts(folder / "prompts.jsonl")
    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    try:
        run = single_controller.launch(
            folder / "work",
            model=model,
            prompts=prompts,
            env={
                "LOSSREDUCE_MODE": "constant",
                "LOSSREDUCE_DIVISOR": str(DIVISOR),
                "LOSSREDUCE_NORMALIZER": "coordinator",
                "LOSSREDUCE_COORDINATOR": thread.target,
            },
            # The actor's workers alone get the job name, from the scheduler's spec.
            overrides=(
                f"+actor.scheduling_spec.0.env_vars.LOSSREDUCE_JOB={JOB}",
                *ENGINES[engine][1],
            ),
            timeout_s=480,
        )
        yield Launch(engine, run, list(thread.coordinator.table.rounds()))
    finally:
        thread.stop()


def _ran(launch: Launch) -> single_controller.ControllerRun:
    done = launch.run.done
    logs = "\n".join(f"== {role}\n{text[-3000:]}" for role, text in launch.run.worker_logs.items())
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n{logs}"
    return launch.run


def test_the_controller_runs_areals_loop_through_its_scheduler(launch: Launch) -> None:
    run = _ran(launch)
    assert "Training completes" in run.done.stdout
    # The scheduler started the workers, and each built the LossReduce actor by its path.
    actor_log = run.worker_logs["actor"]
    for rank in range(WORKERS):
        assert (
            f"Engine 'actor/{rank}' (class: lossreduce.trainer_worker.integrations.areal"
            f".actors.{ENGINES[launch.engine][0]}) instantiated" in actor_log
        )
    # The rollout worker launched the server by vLLM's command line, and that was ours.
    rollout_log = run.worker_logs["rollout"]
    assert f"python3 -m {single_controller.VLLM_MODULE} " in rollout_log
    assert "CPU rollout server for AReaL's vLLM launch on " in rollout_log
    log = run.server_log
    # Every step's responses came from it and every step's weights went back to it.
    assert STEPS * BATCH * SAMPLES <= log["completions"] <= (STEPS + 1) * BATCH * SAMPLES
    assert log["versions"] == [1, 2, 3]
    assert sorted(run.weights) == [1, 2, 3]
    assert log["paused"] == STEPS
    assert log["unknown"] == []


def test_the_workers_read_the_settings_from_the_schedulers_environment(launch: Launch) -> None:
    run = _ran(launch)
    rounds = sorted(launch.rounds, key=lambda r: r.key.step)
    # One round per update, all under the job name only the actor's spec carried.
    assert [r.key.step for r in rounds] == [v * ROUNDS_PER_VERSION for v in range(STEPS)]
    assert {r.key.job for r in rounds} == {JOB}
    for rnd in rounds:
        assert rnd.outcome is not None
        assert rnd.outcome.kind == "completed"
        # Both workers sent, in the mode and divisor of the inherited environment.
        assert rnd.reference.world_size == WORKERS
        assert dict(zip(rnd.reference.terms, rnd.reference.contracts, strict=True))["pg"] == (
            f"mean:constant:divisor={DIVISOR}"
        )
        values = {v.term: v.value for v in rnd.outcome.normalizers}
        # constant's normalizer is the count of active responses: every response here.
        assert values["pg"] == values["rows"] == BATCH * SAMPLES
    # The same normalizers in the stats the controller gathered, once per step.
    logged = re.findall(r"lossreduce/normalizer/pg\s*│\s*([0-9.e+-]+)", run.done.stdout)
    assert [float(v) for v in logged] == [
        {v.term: v.value for v in r.outcome.normalizers}["pg"] for r in rounds
    ]


def test_the_docs_show_the_single_controller_launch() -> None:
    page = DOCS.read_text()
    launch = single_controller.LAUNCH.read_text()
    body = launch[launch.index("import sys") :]
    assert f"```python\n{body}```" in page
