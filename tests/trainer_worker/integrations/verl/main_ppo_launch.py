"""verl's ``python -m verl.trainer.main_ppo`` on CPU, as the tests launch it.

The inputs and the launch are the package's
(:mod:`lossreduce.trainer_worker.cpu_standins.verl.launch`, which
``lossreduce bench --e2e`` runs too); here: the launch as the docs show it, and a
launch that must finish and log every step.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from lossreduce.trainer_worker.cpu_standins.verl.launch import (
    LOSSREDUCE,
    STEPS,
    Inputs,
    Launch,
    launch_env,
    overrides,
    run_main_ppo,
    write_inputs,
)

__all__ = [
    "CLIP_COV",
    "COMPUTE_IN_FLOAT32",
    "LOSSREDUCE",
    "ONE_MINI_BATCH",
    "STEPS",
    "TOKEN_MEAN",
    "Inputs",
    "Launch",
    "documented_command",
    "launch_env",
    "launched",
    "overrides",
    "run_main_ppo",
    "step_data",
    "write_inputs",
]


FLOAT32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
COMPUTE_IN_FLOAT32 = [
    f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FLOAT32}",
    f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FLOAT32}",
]
"""The actor and the reference policy compute in float32: verl's FSDP engine computes in
bfloat16 under autocast when ``fsdp_config.mixed_precision`` is unset, whatever
``model_dtype`` says, and bfloat16 runs on CPU differ from run to run."""
TOKEN_MEAN = ["trainer.v1.trainer_mode=lossreduce", "+actor_rollout_ref.lossreduce.mode=token_mean"]
"""The trainer mode in ``token_mean`` with the torch normalizer (the A/B's lossreduce side)."""
ONE_MINI_BATCH = 4
"""``ppo_mini_batch_size`` of one mini-batch a step: with two, the split follows the order
in which the agent loop's responses finish, which varies from run to run."""
CLIP_COV = [
    "trainer.v1.trainer_mode=lossreduce",
    "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
    # A share of 0.2 of the mini-batch's tokens among those of covariance in (0, 10):
    # several tokens drawn among more candidates, so another draw changes the update.
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.2",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.0",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub=10.0",
    "+actor_rollout_ref.lossreduce.statistics=mini_batch",
]
"""The trainer mode with ``clip_cov``, its draw taken over the whole mini-batch (lossreduce's
default ``statistics``, said explicitly): the uninterrupted run and the resumed ones."""


def documented_command(work: str = "$WORK") -> str:
    """The launch as docs/frameworks/verl.md shows it: :func:`launch_env`, and
    ``main_ppo`` with :func:`overrides` of inputs written under ``work`` plus
    :data:`LOSSREDUCE`."""
    inputs = Inputs(
        model=Path(f"{work}/model"),
        train=Path(f"{work}/train.parquet"),
        reward=Path(f"{work}/reward.py"),
    )
    env = [f"{key}={value}" for key, value in launch_env().items()]
    lines = [*env, "python -m verl.trainer.main_ppo"]
    # Quoted where the shell would glob (``[console,file]``), not where it expands $WORK.
    args = [shlex.quote(a) if "[" in a else a for a in [*overrides(inputs), *LOSSREDUCE]]
    lines += [f"    {arg}" for arg in args]
    return " \\\n".join(lines) + "\n"


def launched(
    folder: Path,
    args: list[str],
    steps: int = STEPS,
    mini_batch_size: int = 2,
    *,
    critic: bool = False,
) -> Launch:
    """The test launch (:func:`overrides`) plus ``args`` in ``folder``, which must finish
    and log every one of its ``steps`` (``critic``: PPO with a critic instead of GRPO)."""
    inputs = write_inputs(folder, critic=critic)
    settings = overrides(inputs, steps=steps, mini_batch_size=mini_batch_size)
    run = run_main_ppo(folder, [*settings, *args])
    if run.returncode != 0:
        raise AssertionError(f"main_ppo exited {run.returncode}:\n{run.output[-8000:]}")
    if run.logged != list(range(1, steps + 1)):
        raise AssertionError(f"main_ppo logged steps {run.logged}:\n{run.output[-4000:]}")
    return run


def step_data(run: Launch, step: int) -> dict[str, Any]:
    """What verl's file logger wrote for ``step`` (1-based)."""
    return dict(run.steps[step - 1]["data"])
