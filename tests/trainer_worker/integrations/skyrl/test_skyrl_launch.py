"""SkyRL's own launch, ``python -m skyrl.train.entrypoints.main_base``, with lossreduce.

Every launch is SkyRL's ``main_base`` dispatching to lossreduce's entrypoint
(``trainer.override_entrypoint``) on CPU (``cpu_standins.skyrl.launch``): PPO with GAE
on a tiny Qwen2, 2 policy ranks, 2 reference ranks and 2 critic ranks over gloo, 4
prompts x 2 responses a step, the KL and entropy losses on, the policy loss and the
critic's value loss both in ``prompt_mean`` through the job's own coordinator actor
(``LossReducePolicyWorker`` and ``LossReduceCriticWorker``, one round each a step),
float32, a checkpoint and an exported policy and critic every step. Generation is the
stand-in server of ``cpu_standins.skyrl.inference`` (vLLM does not run on CPU). GRPO
is covered by the worker tests (``test_skyrl_worker.py``), whose policy worker does
not depend on the advantage estimator.

- one launch trains 3 steps uninterrupted;
- one is killed with SIGKILL once checkpoint 2 is written, and relaunched unchanged
  but for ``trainer.resume_mode=latest``: it continues at step 3 with the policy's and
  the critic's rounds where the checkpoint left them, and its numbers and weights
  (policy and critic) equal the uninterrupted run's;
- bad settings are refused in the driver before Ray starts.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lossreduce.trainer_worker.cpu_standins.skyrl import launch
from tests.trainer_worker.integrations.skyrl.skyrl_launches import (
    CLAIMED,
    LAUNCH_TIMEOUT_S,
    Launched,
    dumped_batches,
    exported_weights,
    finished,
    start,
    wait_for_checkpoint,
)

STEPS = 3
EXPORT_EVERY_STEP = ["trainer.hf_save_interval=1"]
COMPARED = (
    "policy/final_loss",
    "policy/policy_loss",
    "policy/lossreduce/kl_loss",
    "policy/lossreduce/entropy_loss",
    "policy/grad_norm",
    "policy/policy_entropy",
    "policy/policy_kl",
    "loss/avg_raw_advantages_abs",
    "reward/avg_raw_reward",
    "critic/critic_loss",
    "critic/grad_norm",
    "critic/values_mean",
)
"""Metrics a resumed step must reproduce (relative 1e-6, absolute 1e-7)."""

# A test's setup may run up to two launches (the killed one and its relaunch), each
# allowed LAUNCH_TIMEOUT_S, as verl's and AReaL's resume modules allow theirs; pytest's
# default 600 s cut the resume fixture on a loaded CI machine.
pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> launch.Inputs:
    return launch.write_inputs(tmp_path_factory.mktemp("skyrl-inputs"))


@pytest.fixture(scope="module")
def server(inputs: launch.Inputs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("skyrl-server") / "server.log"
    with launch.standin_server(inputs.model, log) as url:
        yield url


@pytest.fixture(scope="module")
def uninterrupted(
    inputs: launch.Inputs, server: str, tmp_path_factory: pytest.TempPathFactory
) -> Launched:
    work = tmp_path_factory.mktemp("uninterrupted")
    running = start(
        "uninterrupted", work, inputs, server, EXPORT_EVERY_STEP, steps=STEPS, critic=True
    )
    try:
        return finished(running, work).check()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def resumed(
    inputs: launch.Inputs, server: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Launched, Launched]:
    """The killed launch (after checkpoint 2) and its relaunch."""
    work = tmp_path_factory.mktemp("resumed")
    killed = start("killed", work, inputs, server, EXPORT_EVERY_STEP, steps=STEPS, critic=True)
    try:
        wait_for_checkpoint(killed, work, 2, LAUNCH_TIMEOUT_S)
        killed.kill_driver()
    finally:
        killed.stop()
    relaunch = start(
        "relaunch",
        work,
        inputs,
        server,
        [*EXPORT_EVERY_STEP, "trainer.resume_mode=latest"],
        steps=STEPS,
        critic=True,
    )
    try:
        after = finished(relaunch, work).check()
    finally:
        relaunch.stop()
    before = finished(killed, work)
    return before, after


def close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-7)


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float(want[n].double().pow(2).sum()) for n in want)
    return math.sqrt(num / den)


# -- the launch ------------------------------------------------------------------------


def claims(output: str) -> dict[str, dict[str, str]]:
    """The claims the trainer logged, by group."""
    return {m["group"]: m.groupdict() for m in CLAIMED.finditer(output)}


def test_main_base_trains_three_steps_with_lossreduce(uninterrupted: Launched) -> None:
    """The policy and the critic claim their groups of the run's job from round 0, and
    each trains one round a step."""
    claimed = claims(uninterrupted.output)
    assert sorted(claimed) == ["critic", "policy"], uninterrupted.output[-4000:]
    run = claimed["policy"]["run"]
    for claim in claimed.values():
        assert claim["step"] == "0"
        assert claim["run"] == run
        assert claim["job"] == f"skyrl-ppo-{run}"
    assert sorted(uninterrupted.steps) == [1, 2, 3]
    for step, metrics in uninterrupted.steps.items():
        for model in ("policy", "critic"):
            # One mini-batch (one round) a step, numbered on from step to step.
            assert metrics[f"{model}/lossreduce/round_min"] == step - 1
            assert metrics[f"{model}/lossreduce/round_max"] == step - 1
            assert metrics[f"{model}/lossreduce/skipped"] == 0.0
            assert math.isfinite(metrics[f"{model}/grad_norm"])
            assert metrics[f"{model}/grad_norm"] > 0
        for term in ("pg", "kl", "entropy"):
            assert metrics[f"policy/lossreduce/normalizer/{term}"] > 0
        assert math.isfinite(metrics["critic/critic_loss"])


def test_each_rounds_normalizers_are_skyrls_own_counts(uninterrupted: Launched) -> None:
    """``prompt_mean``: the prompt groups of SkyRL's mini-batch (its
    ``policy_prompt_boundaries``, none of them empty here), for the policy loss and the
    critic's value loss; the KL and entropy terms in ``token_mean``: its loss-mask sum,
    SkyRL's own ``token_mean`` denominator."""
    batches = dumped_batches(uninterrupted.work)
    assert sorted(batches) == [1, 2, 3]
    for step, batch in batches.items():
        metrics = uninterrupted.steps[step]
        mask = batch["loss_mask"]
        prompts = batch.metadata["policy_prompt_boundaries"]
        assert all(mask[start:end].sum() > 0 for start, end in prompts)
        assert metrics["policy/lossreduce/normalizer/pg"] == len(prompts)
        assert metrics["critic/lossreduce/normalizer/vf"] == len(prompts)
        assert metrics["policy/lossreduce/normalizer/kl"] == float(mask.sum())
        assert metrics["policy/lossreduce/normalizer/entropy"] == float(mask.sum())


# -- kill and resume -------------------------------------------------------------------


def test_a_killed_run_resumes_at_step_3_with_the_uninterrupted_numbers(
    uninterrupted: Launched, resumed: tuple[Launched, Launched]
) -> None:
    killed, relaunch = resumed
    assert killed.returncode == -9
    assert 3 not in killed.steps
    assert sorted(relaunch.steps) == [3]
    claimed = claims(relaunch.output)
    assert sorted(claimed) == ["critic", "policy"], relaunch.output[-4000:]
    for claim in claimed.values():
        assert claim["step"] == "2"  # the checkpoint's round counter
    step3, want = relaunch.steps[3], uninterrupted.steps[3]
    assert step3["policy/lossreduce/round_min"] == 2.0
    assert step3["critic/lossreduce/round_min"] == 2.0
    for key in COMPARED:
        assert close(step3[key], want[key]), (key, step3[key], want[key])
    for step in (1, 2):
        for key in COMPARED:
            if step in killed.steps:
                got = killed.steps[step][key]
                assert close(got, uninterrupted.steps[step][key]), (step, key)
    for model in ("policy", "critic"):
        weights = exported_weights(relaunch.work, 3, model)
        assert relative(weights, exported_weights(uninterrupted.work, 3, model)) <= 1e-6
        # It trained.
        assert relative(weights, exported_weights(uninterrupted.work, 2, model)) > 1e-4


# -- refused before Ray starts ---------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "trainer.lossreduce.mode=bogus",
            "trainer.lossreduce.mode=bogus: must be one of token_mean, seq_mean, prompt_mean, "
            "constant",
        ),
        (
            "trainer.lossreduce.on_empty_step=later",
            "trainer.lossreduce.on_empty_step=later: must be one of raise, skip",
        ),
        (
            "trainer.algorithm.policy_loss_type=clip_cov",
            "trainer.algorithm.policy_loss_type='clip_cov': it centres advantages",
        ),
    ],
)
def test_a_bad_setting_is_refused_before_ray_starts(
    inputs: launch.Inputs, tmp_path: Path, setting: str, message: str
) -> None:
    args = [
        *launch.LOSSREDUCE,
        *launch.overrides(tmp_path, inputs, "http://127.0.0.1:9", steps=1),
        setting,
    ]
    done = subprocess.run(
        launch.main_base_command(args),
        env=launch.launch_env(tmp_path / "tensorboard"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ReductionConfigError" in output
    assert message in output, output[-3000:]
    assert "Started a local Ray instance" not in output
