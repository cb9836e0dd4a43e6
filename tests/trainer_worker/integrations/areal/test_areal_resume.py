"""A LossReduce AReaL run SIGKILLed after step 2 and relaunched with AReaL's own recovery
continues at step 3 as if it had never stopped; a second launch of the job is refused.

The launch of ``test_areal_trainer_loop.py`` (``grpo_launch.py`` under ``torchrun``, 2
gloo ranks, the CPU rollout server) with AReaL's recover settings on
(``recover.mode=on``, a checkpoint after every step: ``resume_runs.RECOVER``):

- an uninterrupted 3-step run, the reference;
- a run stopped after step 2's recover checkpoint and SIGKILLed there (torchrun and
  both ranks), then relaunched unchanged in the same folder: AReaL restores the
  weights, optimizer, data loader and weight version, pushes the weights to a fresh
  rollout server, and the run trains step 3 only. Its step-3 update (the weights the
  server receives, and the stats AReaL prints) equals the reference's to 1e-6 in
  float32, with the same seeds. The killed run draws no prompt ahead of its steps
  (``halting_trainer``), which its checkpoint is checked for.

Both with an external ``lossreduce serve`` (explicit job: the rounds continue the
numbering, 0, 1024, 2048, and the resumed run, a new run id, takes the job's claim
over from the killed one) and with the integration's default backend,
torch.distributed (no coordinator). While the killed run is stopped, a second launch
under its job is refused at start-up with ``RunConflictError`` naming the holder,
before its rollout has asked for a single completion.

Six launches (two of them stopped early or refused): about 9 minutes measured on a
heavily loaded 2-core machine (a single 3-step launch takes 45 s there when idle).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lossreduce.trainer_worker.integrations.areal.actor import ROUNDS_PER_VERSION
from tests.trainer_worker.integrations.areal import resume_runs, trainer_loop

# A fixture launches three runs (the killed one, the second launch, the relaunch) before
# its first test: 4 to 6 minutes on a loaded 2-core machine, past pytest's 600 s default.
pytestmark = pytest.mark.timeout(1500)

STEPS = 3
HALT = 2  # the killed run's last step
BATCH = 4  # prompts per step (train_dataset.batch_size)
SAMPLES = 2  # gconfig.n_samples
JOB = "areal-resume"
WHOLE_JOB = "areal-resume-whole"
STATS = (
    "ppo_actor/update/grad_norm",
    "ppo_actor/update/actor_loss/avg",
    "ppo_actor/update/lossreduce/normalizer/pg",
    "ppo_actor/update/n_valid_tokens",
    "ppo_actor/task_reward/avg",
)
"""Step stats compared with the reference's (AReaL prints 5 significant digits)."""


@dataclass
class Resumed:
    """A run killed after step ``HALT`` and its relaunch."""

    killed_output: str
    killed_server: dict[str, Any]  # what the killed run's rollout server served
    checkpointed: dict[str, int]  # the killed run's last recover checkpoint (0-based steps)
    drawn: list[int]  # prompts each rank had drawn at that checkpoint
    killed_weights: dict[int, dict[str, torch.Tensor]]  # version -> what the killed run sent
    resumed: trainer_loop.Launched
    holder: str = ""  # the run holding JOB while the killed run was stopped
    second: trainer_loop.Launched | None = None  # the concurrent second launch


def _coordinator_env(serve: resume_runs.Serve, job: str) -> dict[str, str]:
    return {
        "LOSSREDUCE_MODE": "token_mean",
        "LOSSREDUCE_NORMALIZER": "coordinator",
        "LOSSREDUCE_COORDINATOR": serve.target,
        "LOSSREDUCE_JOB": job,
    }


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("resume")
    return trainer_loop.save_policy(folder / "model"), trainer_loop.save_prompts(
        folder / "prompts.jsonl"
    )


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[resume_runs.Serve]:
    process = resume_runs.start_serve_process(tmp_path_factory.mktemp("serve"))
    try:
        yield process
    finally:
        process.stop()


def _launch(policy: tuple[Path, Path], work: Path, env: dict[str, str]) -> trainer_loop.Launched:
    model, prompts = policy
    return trainer_loop.launch(
        False, work, model=model, prompts=prompts, env=env, overrides=resume_runs.RECOVER
    )


def _completed(run: trainer_loop.Launched) -> trainer_loop.Launched:
    done = run.done
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return run


@pytest.fixture(scope="module")
def whole(
    policy: tuple[Path, Path],
    serve: resume_runs.Serve,
    tmp_path_factory: pytest.TempPathFactory,
) -> trainer_loop.Launched:
    env = _coordinator_env(serve, WHOLE_JOB)
    return _completed(_launch(policy, tmp_path_factory.mktemp("whole"), env))


def _killed_and_resumed(
    policy: tuple[Path, Path],
    work: Path,
    env: dict[str, str],
    while_stopped: Callable[[], dict[str, Any]] | None = None,
) -> Resumed:
    """Run to step ``HALT``, call ``while_stopped()`` (its result kept), SIGKILL, relaunch."""
    model, prompts = policy
    killed = resume_runs.start_halted(
        work,
        model=model,
        prompts=prompts,
        env=env,
        halt_after=HALT,
        overrides=resume_runs.RECOVER,
    )
    try:
        extra = while_stopped() if while_stopped is not None else {}
    finally:
        killed_server = killed.kill()
    last, drawn = resume_runs.checkpointed(work), resume_runs.drawn(work)
    resume_runs.clear_name_records(work)
    resumed = _completed(_launch(policy, work, env))
    sent = resume_runs.received(work / "halted")
    return Resumed(killed.text(), killed_server, last, drawn, sent, resumed, **extra)


@pytest.fixture(scope="module")
def with_coordinator(
    policy: tuple[Path, Path],
    serve: resume_runs.Serve,
    tmp_path_factory: pytest.TempPathFactory,
) -> Resumed:
    env = _coordinator_env(serve, JOB)

    def second_launch() -> dict[str, Any]:
        holder = serve.holders(JOB).get("actor", "")
        # The same launch in a folder of its own: a new run, not a recovery.
        second = _launch(policy, tmp_path_factory.mktemp("second"), env)
        return {"holder": holder, "second": second}

    return _killed_and_resumed(policy, tmp_path_factory.mktemp("killed"), env, second_launch)


@pytest.fixture(scope="module")
def with_torch(policy: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    # No LOSSREDUCE_* variable: torch.distributed over the actor's data-parallel group.
    return _killed_and_resumed(policy, tmp_path_factory.mktemp("killed-torch"), {})


BACKENDS = (
    "with_coordinator",
    # The same kill and relaunch over torch.distributed: a second variant of what
    # with_coordinator shows (two launches), run by `make test-all`.
    pytest.param("with_torch", marks=pytest.mark.extended),
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_killed_run_stopped_after_step_2(backend: str, request: pytest.FixtureRequest) -> None:
    run: Resumed = request.getfixturevalue(backend)
    # Its last recover checkpoint is step 2's (AReaL's 0-based global step 1), and it
    # was stopped within it: step 2's stats, which AReaL commits after the checkpoint,
    # were never printed.
    assert run.checkpointed == {"global_step": HALT - 1, "epoch_step": HALT - 1, "epoch": 0}
    assert sorted(resume_runs.step_stats(run.killed_output)) == list(range(1, HALT))
    # Each rank had drawn its prompts of steps 1 and 2 and none ahead (halting_trainer).
    assert run.drawn == [HALT * BATCH // 2] * 2
    # It sent the weights of versions 1 and 2, and (its rollout paused for the
    # checkpoint) asked for nothing of step 3.
    assert run.killed_server["versions"] == [1, 2]
    assert run.killed_server["completions"] == HALT * BATCH * SAMPLES


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_relaunch_recovers_and_trains_step_3_only(
    backend: str, request: pytest.FixtureRequest
) -> None:
    run: Resumed = request.getfixturevalue(backend)
    stdout = run.resumed.done.stdout
    recovered = re.search(r"Recovering from StepInfo\(([^)]*)\)", stdout)
    assert recovered is not None, stdout[-4000:]
    assert f"global_step={HALT}" in recovered.group(1)
    assert "Training completes" in stdout
    assert sorted(resume_runs.step_stats(stdout)) == [STEPS]
    # AReaL pushed the recovered weights (version 2) to the fresh server, then step 3's;
    # the recovered ones are bit for bit those the killed run had sent after step 2.
    assert run.resumed.server_log["versions"] == [HALT, STEPS]
    ours, theirs = run.resumed.weights[HALT], run.killed_weights[HALT]
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert run.resumed.server_log["unknown"] == []


def _relative(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """||ours - theirs|| / ||theirs||, over every parameter."""
    assert sorted(ours) == sorted(theirs)
    diff = sum(float((ours[n].double() - theirs[n].double()).pow(2).sum()) for n in theirs)
    size = sum(float(theirs[n].double().pow(2).sum()) for n in theirs)
    return math.sqrt(diff / size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_3_equals_the_uninterrupted_runs(
    backend: str, request: pytest.FixtureRequest, whole: trainer_loop.Launched
) -> None:
    run: Resumed = request.getfixturevalue(backend)
    assert whole.server_log["versions"] == [1, 2, 3]
    # The recovered weights, and step 3's update of them.
    for version in (HALT, STEPS):
        assert _relative(run.resumed.weights[version], whole.weights[version]) < 1e-6
    moved = _relative(whole.weights[STEPS], whole.weights[HALT])
    assert moved > 1e-6, "step 3 did not move the weights"
    ours = resume_runs.step_stats(run.resumed.done.stdout)[STEPS]
    theirs = resume_runs.step_stats(whole.done.stdout)[STEPS]
    for name in STATS:
        assert math.isclose(ours[name], theirs[name], rel_tol=1e-4, abs_tol=1e-9), name


def test_rounds_continue_the_numbering_under_the_resumed_runs_claim(
    with_coordinator: Resumed, serve: resume_runs.Serve, whole: trainer_loop.Launched
) -> None:
    rounds = serve.rounds(JOB)
    assert sorted(rounds) == [v * ROUNDS_PER_VERSION for v in range(STEPS)]
    reference = serve.rounds(WHOLE_JOB)
    assert sorted(reference) == sorted(rounds)
    for step, payload in rounds.items():
        # Exact: the same tokens on the same ranks, summed in float64.
        assert resume_runs.round_normalizers(payload) == resume_runs.round_normalizers(
            reference[step]
        )
    # The killed run held the job; the relaunch (a run id of its own) took it over
    # at step 2048, past every round of the killed run.
    assert with_coordinator.holder
    now = serve.holders(JOB)["actor"]
    assert now
    assert now != with_coordinator.holder


def test_a_second_launch_is_refused_before_its_rollout(with_coordinator: Resumed) -> None:
    second = with_coordinator.second
    assert second is not None
    done = second.done
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "RunConflictError" in output, output[-6000:]
    assert with_coordinator.holder in output
    assert second.server_log["completions"] == 0
    assert second.server_log["versions"] == []
