"""verl's ``main_ppo`` with the trainer mode, killed and resumed, and launched twice at once.

A user's path past the first launch, on the CPU launch of :mod:`.main_ppo_launch` (3
GRPO steps on 2 gloo ranks, in float32, one mini-batch a step so every step's split
is the same from run to run) with ``clip_cov``
(:data:`~.main_ppo_launch.CLIP_COV`: a share of each mini-batch's tokens drawn among
more candidates, their loss zeroed): the trainer checkpoints every step
(``trainer.save_freq=1``), its driver is killed with SIGKILL as soon as checkpoint 2
is complete, and the same command relaunched (``trainer.resume_mode=auto``) must
continue at step 3 with round 2, under a run identity of its own, and train step 3
exactly as a run that was never interrupted, the same tokens drawn: to 1e-6 in
float32, with the same seeds (relative, or 1e-7 absolute: the policy loss is a mean of
terms of about ±0.7 that nearly cancel, and two uninterrupted runs already differ in it
by about 1e-7 relative). The draw is keyed by the job as configured (not the run id),
verl's ``data_loader_seed`` and the round, so it holds across the kill, the new run and
the job's name with or without the run id; keyed by the rounds' job (with the run id,
as it was before), step 1 already differs from the uninterrupted run's.

Both kinds of coordinator:

- a ``lossreduce serve`` that outlives the launches, with an explicit job (named as
  verl's default, ``verl-ppo``: the uninterrupted run's job without its run id, so both
  draw with one key): the resumed
  run takes the group's claim over from the killed one. While the first launch runs,
  a second launch of the same command is refused with ``RunConflictError`` naming the
  first launch's run, at the end of its start-up, before any rollout;
- the job's own coordinator actor (no address, the default job): the SIGKILL ends the
  Ray job and the actor with it, its journal stays behind, and the resumed launch
  starts a coordinator of its own under a job of its own.

Two launches of its own and a third refused at its start-up, each 1 to 2 minutes on 2
cores; the uninterrupted run is conftest's ``clip_cov_float32`` (the job's own
coordinator actor, verl's default job), ``test_main_ppo_losses.py``'s Clip-Cov launch.
The coordinator actor's variant (two launches more; exactly the uninterrupted run's
command, killed and resumed) repeats the same kill and relaunch: it is marked
``extended`` and ``make test-all`` runs it.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.trainer_worker.integrations.verl.background_launch import (
    Background,
    checkpoint_of,
    start,
)
from tests.trainer_worker.integrations.verl.main_ppo_launch import (
    CLIP_COV,
    COMPUTE_IN_FLOAT32,
    ONE_MINI_BATCH,
    STEPS,
    Inputs,
    Launch,
    overrides,
    step_data,
    write_inputs,
)
from tests.trainer_worker.integrations.verl.test_main_ppo_ab import COMPARED

pytestmark = pytest.mark.timeout(1500)

KILLED_AFTER = 2
JOB = "verl-ppo"
"""The explicit job of the resume through ``lossreduce serve``: verl's default name, which
the uninterrupted run's rounds carry with its run id (``verl-ppo-<run>``)."""
# What the draw decides, besides the update's numbers (COMPARED).
DRAWN = [
    "actor/lossreduce/stats/selected",
    "actor/lossreduce/stats/candidates",
    "actor/lossreduce/stats/active_tokens",
]
LAUNCH_TIMEOUT_S = 600.0


def command(inputs: Inputs, folder: Path, lossreduce: list[str]) -> list[str]:
    """The uninterrupted run's launch (conftest's ``clip_cov_float32``) through a
    coordinator, checkpointing every step to ``folder`` and resuming from there, plus
    ``lossreduce`` settings."""
    launch = [
        arg
        for arg in overrides(inputs, steps=STEPS, mini_batch_size=ONE_MINI_BATCH)
        if not arg.startswith("trainer.save_freq=")
    ]
    return [
        *launch,
        *COMPUTE_IN_FLOAT32,
        *CLIP_COV,
        "+actor_rollout_ref.lossreduce.normalizer=coordinator",
        "trainer.save_freq=1",
        f"trainer.default_local_dir={checkpoint_of(folder)}",
        "trainer.resume_mode=auto",
        *lossreduce,
    ]


@dataclass(frozen=True)
class Resume:
    """A launch killed after checkpoint 2, the same command relaunched, and their claims."""

    folder: Path
    killed: Launch
    resumed: Launch
    killed_run: str
    resumed_claim: dict[str, str | None]


def claim_of(launch: Background) -> dict[str, str | None]:
    found = launch.claim()
    assert found is not None, f"{launch.name}: no claim line:\n{launch.output()[-4000:]}"
    return found.groupdict()


def kill_after_checkpoint(launch: Background) -> Launch:
    launch.wait_for_checkpoint(KILLED_AFTER, LAUNCH_TIMEOUT_S)
    launch.kill_driver()
    return launch.wait(timeout=1)


def resume(folder: Path, args: list[str], first: Background) -> Resume:
    """Kill ``first`` after checkpoint 2 (if not killed yet), then relaunch ``args``."""
    killed = kill_after_checkpoint(first) if first.process.poll() is None else first.wait(1)
    killed_run = claim_of(first)["run"]
    assert killed_run is not None
    second = start("resumed", folder, args)
    try:
        resumed = second.wait(LAUNCH_TIMEOUT_S)
        return Resume(folder, killed, resumed, killed_run, claim_of(second))
    finally:
        second.stop()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return write_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``lossreduce serve`` on a free loopback port, outliving every launch."""
    folder = tmp_path_factory.mktemp("serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOSSREDUCE_")}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "lossreduce"), "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=folder,
        env={**env, "PYTHONUNBUFFERED": "1", "LOSSREDUCE_METRICS_PORT": "0"},
    )
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    found = re.search(r"serving on (127\.0\.0\.1:\d+)", banner)
    assert found is not None, banner + proc.stdout.read()
    yield found.group(1)
    proc.terminate()
    proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def reference(clip_cov_float32: Launch) -> Launch:
    """The same launch, never interrupted, with verl's default job (its own coordinator
    actor: which coordinator sums the partials changes no number)."""
    return clip_cov_float32


@dataclass(frozen=True)
class Served:
    """The resume against ``lossreduce serve``, and the rival launched meanwhile."""

    resume: Resume
    rival: Launch
    rival_seconds: float


@pytest.fixture(scope="module")
def with_serve(inputs: Inputs, served: str, tmp_path_factory: pytest.TempPathFactory) -> Served:
    settings = [
        f"+actor_rollout_ref.lossreduce.coordinator={served}",
        f"+actor_rollout_ref.lossreduce.job={JOB}",
    ]
    folder = tmp_path_factory.mktemp("serve-resume")
    rival_folder = tmp_path_factory.mktemp("serve-rival")
    first = start("killed", folder, command(inputs, folder, settings))
    rival: Background | None = None
    try:
        first.wait_for_claim(LAUNCH_TIMEOUT_S)
        # The same command (its own checkpoint folder), while the first one trains; the
        # first is killed after checkpoint 2 whenever that comes meanwhile.
        rival = start("rival", rival_folder, command(inputs, rival_folder, settings))
        with ThreadPoolExecutor(1) as pool:
            killing = pool.submit(kill_after_checkpoint, first)
            rival_launch = rival.wait(LAUNCH_TIMEOUT_S)
            killing.result()
        return Served(
            resume(folder, command(inputs, folder, settings), first),
            rival_launch,
            rival.seconds(),
        )
    finally:
        first.stop()
        if rival is not None:
            rival.stop()


@pytest.fixture(scope="module")
def with_actor(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory) -> Resume:
    folder = tmp_path_factory.mktemp("actor-resume")
    first = start("killed", folder, command(inputs, folder, []))
    try:
        return resume(folder, command(inputs, folder, []), first)
    finally:
        first.stop()


def check_resume(run: Resume, reference: Launch) -> None:
    # The driver died of the SIGKILL after logging steps 1 and 2.
    assert run.killed.returncode == -9, run.killed.output[-4000:]
    assert run.killed.logged == [1, 2], run.killed.output[-4000:]
    assert run.resumed.returncode == 0, run.resumed.output[-8000:]
    # The relaunch continued at step 3, with round 2 (one round a mini-batch).
    assert run.resumed.logged == [STEPS], run.resumed.output[-4000:]
    data = step_data_at(run.resumed, STEPS)
    assert data["actor/lossreduce/round_min"] == data["actor/lossreduce/round_max"] == 2.0
    assert run.resumed_claim["step"] == "2"
    # Under a run identity of its own (drawn afresh: no run was set).
    assert run.resumed_claim["run"] != run.killed_run
    # clip_cov drew tokens at step 3, among more candidates: another draw would zero
    # other tokens' loss and move the numbers compared below.
    drawn = step_data(reference, STEPS)
    assert 1 <= drawn[DRAWN[0]] < drawn[DRAWN[1]], drawn
    # Steps 1-2 before the kill, and step 3 after the resume, are the uninterrupted run's,
    # the same tokens drawn.
    for launch, step in [(run.killed, 1), (run.killed, 2), (run.resumed, 3)]:
        mine, theirs = step_data_at(launch, step), step_data(reference, step)
        for key in DRAWN:
            assert mine[key] == theirs[key], (step, key, mine[key], theirs[key])
        for key in COMPARED:
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-6, abs_tol=1e-7), (
                step,
                key,
                mine[key],
                theirs[key],
            )


def step_data_at(run: Launch, step: int) -> dict[str, float]:
    """What verl's file logger wrote for ``step`` (a resumed run logs from its own first)."""
    (found,) = [s["data"] for s in run.steps if s["step"] == step]
    return dict(found)


def test_the_uninterrupted_run_trained(reference: Launch) -> None:
    assert reference.returncode == 0, reference.output[-8000:]
    assert reference.logged == [1, 2, 3], reference.output[-4000:]
    assert step_data(reference, 1)["actor/grad_norm"] > 0
    assert step_data(reference, 1)["actor/lossreduce/stats/selected"] >= 1


def test_resumed_against_lossreduce_serve(with_serve: Served, reference: Launch) -> None:
    run = with_serve.resume
    check_resume(run, reference)
    # The job was given: kept as is, and the resumed run took its claim over.
    assert run.resumed_claim["job"] == JOB
    assert run.resumed_claim["took_over"] is not None, run.resumed.output[-4000:]


def test_a_second_launch_is_refused_before_its_rollout(with_serve: Served) -> None:
    rival = with_serve.rival
    holder = with_serve.resume.killed_run
    assert rival.returncode != 0
    assert "RunConflictError" in rival.output, rival.output[-8000:]
    assert f"run {holder!r} holds job {JOB!r} group 'actor'" in rival.output, rival.output[-8000:]
    # Refused at its claim, at the end of verl's set-up: its trainer never reached its
    # training loop (whose first act is opening verl's file logger), so no rollout ran.
    assert "lossreduce: run" not in rival.output
    assert "Creating file logger" not in rival.output
    assert rival.steps == []


# The same kill after step 2 and relaunch as test_resumed_against_lossreduce_serve, through
# the job's own coordinator actor: a second variant (two launches), run by `make test-all`.
@pytest.mark.extended
def test_resumed_with_the_jobs_own_coordinator_actor(with_actor: Resume, reference: Launch) -> None:
    check_resume(with_actor, reference)
    # The default job carries the run: the relaunch's job is new, so is its coordinator
    # actor (the killed run's died with its Ray job), which had nothing to take over.
    assert with_actor.resumed_claim["job"] == f"verl-ppo-{with_actor.resumed_claim['run']}"
    assert with_actor.resumed_claim["took_over"] is None
    # The killed run's coordinator journal stays on disk (a crash keeps it, for the
    # retention sweep); no later coordinator opens it.
    left = sorted(p.name for p in (with_actor.folder / "tmp").glob("lossreduce-coordinator-*"))
    assert any(f"verl-ppo-{with_actor.killed_run}-" in name for name in left), left
