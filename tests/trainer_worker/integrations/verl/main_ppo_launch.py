"""verl's ``python -m verl.trainer.main_ppo`` on CPU: the inputs a test writes and the launch.

Everything is verl's own but generation (lossreduce's CPU rollout,
:mod:`lossreduce.trainer_worker.integrations.verl.cpu_rollout`): a tiny Qwen2 built
from a config and a word-level tokenizer with a chat template (no hub), a parquet
dataset of letter prompts, a rule reward (does the response contain the prompt's
letter), GRPO with ``rollout.n=2`` and the KL loss on, 2 gloo ranks, verl's file
logger writing every step's metrics.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.trainer_worker.integrations.verl import tiny_verl
from tests.trainer_worker.integrations.verl.verl_runs import VERL_ENV

LOSSREDUCE = [
    "trainer.v1.trainer_mode=lossreduce",
    "+actor_rollout_ref.lossreduce.mode=prompt_mean",
    "+actor_rollout_ref.lossreduce.normalizer=coordinator",
]
"""The launch's lossreduce part: the trainer mode, the mode, and the job's own
coordinator actor (no address)."""
EXTERNAL_MODULES = ",".join(
    [
        "lossreduce.trainer_worker.integrations.verl.cpu_platform",
        "lossreduce.trainer_worker.integrations.verl.cpu_rollout",
    ]
)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    letters = [c for c in solution_str if c.isalpha()]
    return sum(c in ground_truth for c in letters) / max(len(letters), 1)
"""
GOOD = "abcdefghijklm"
"""The reward: the share of the response's letters among these (a dense score, so
GRPO's advantages, and with them the first update, are not all zero). verl decodes
with ``skip_special_tokens``, which joins the word-level tokens without spaces."""
PROMPTS = 8
STEPS = 3


@dataclass(frozen=True)
class Inputs:
    model: Path
    train: Path
    reward: Path


def write_inputs(folder: Path) -> Inputs:
    """The model, tokenizer, dataset and reward function of a run, under ``folder``."""
    import pandas as pd

    model = tiny_verl.save_model(folder / "model", chat=True)
    tok = tiny_verl.tokenizer(chat=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model)
    letters = tiny_verl.WORDS[2:]
    rows = [
        {
            "data_source": "letters",
            "prompt": [{"role": "user", "content": f"{letters[i]} {letters[i + 1]}"}],
            "reward_model": {"style": "rule", "ground_truth": GOOD},
            "extra_info": {"index": i},
        }
        for i in range(PROMPTS)
    ]
    train = folder / "train.parquet"
    pd.DataFrame(rows).to_parquet(train)
    reward = folder / "reward.py"
    reward.write_text(REWARD)
    return Inputs(model=model, train=train, reward=reward)


def overrides(
    inputs: Inputs,
    *,
    seed: int = 1,
    steps: int = STEPS,
    mini_batch_size: int = 2,
    cuda: bool = False,
) -> list[str]:
    """The run's Hydra overrides (data, model, sizes) without the trainer mode: on 2 CPU
    ranks, or with ``cuda`` on one GPU (scripts/gpu_check.sh)."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={inputs.train}",
        f"data.val_files={inputs.train}",
        "data.train_batch_size=4",
        "data.max_prompt_length=8",
        "data.max_response_length=4",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={inputs.model}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.strategy=fsdp2",
        # Prompts per mini-batch (optimizer step): 2, two mini-batches a training step.
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_size}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.rollout.name=cpu",
        "actor_rollout_ref.rollout.n=2",
        # One rollout replica for both ranks (the CPU server does not shard): one server
        # answers every request, so the per-prompt streams of full determinism hold.
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={1 if cuda else 2}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.rollout.full_determinism=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={inputs.reward}",
        f"trainer.n_gpus_per_node={1 if cuda else 2}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.project_name=lossreduce-test",
        # verl's TransferQueue, agent-loop and reward actors each ask for a CPU: more
        # logical CPUs than the machine's 2 keep them from waiting on the workers'.
        "ray_kwargs.ray_init.num_cpus=16",
    ] + (
        []
        if cuda
        else [
            # verl checks the cluster for GPUs before it places its workers (on the CPU
            # platform they then ask for CPUs): two logical ones, never used.
            "+ray_kwargs.ray_init.num_gpus=2",
        ]
    )


def launch_env(*, cuda: bool = False) -> dict[str, str]:
    """The environment a launch sets: the CPU rollout, and on CPU verl's CPU platform."""
    if cuda:
        return {
            "VERL_USE_EXTERNAL_MODULES": "lossreduce.trainer_worker.integrations.verl.cpu_rollout"
        }
    return {
        "VERL_PLATFORM": VERL_ENV["VERL_PLATFORM"],
        "VERL_ENGINE_DEVICE": VERL_ENV["VERL_ENGINE_DEVICE"],
        "VERL_USE_EXTERNAL_MODULES": EXTERNAL_MODULES,
    }


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


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str
    steps: list[dict[str, Any]]


def run_main_ppo(
    folder: Path, args: list[str], timeout: float = 600, *, cuda: bool = False
) -> Launch:
    """``python -m verl.trainer.main_ppo *args`` in a fresh process (its own local Ray),
    verl's file logger writing to ``folder/metrics.jsonl``."""
    metrics = folder / "metrics.jsonl"
    cpu_only = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_USE_EXTERNAL_MODULES")
    base = {k: v for k, v in VERL_ENV.items() if not (cuda and k in cpu_only)}
    env = {
        **os.environ,
        **base,
        **launch_env(cuda=cuda),
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "PYTHONWARNINGS": "ignore",
        "RAY_DEDUP_LOGS": "0",
    }
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    steps = []
    if metrics.exists():
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return Launch(done.returncode, done.stdout + done.stderr, steps)


def launched(folder: Path, args: list[str], steps: int = STEPS, mini_batch_size: int = 2) -> Launch:
    """The test launch (:func:`overrides`) plus ``args`` in ``folder``, which must finish
    and log every one of its ``steps``."""
    inputs = write_inputs(folder)
    settings = overrides(inputs, steps=steps, mini_batch_size=mini_batch_size)
    run = run_main_ppo(folder, [*settings, *args])
    if run.returncode != 0:
        raise AssertionError(f"main_ppo exited {run.returncode}:\n{run.output[-8000:]}")
    logged = [s["step"] for s in run.steps]
    if logged != list(range(1, steps + 1)):
        raise AssertionError(f"main_ppo logged steps {logged}:\n{run.output[-4000:]}")
    return run


def step_data(run: Launch, step: int) -> dict[str, Any]:
    """What verl's file logger wrote for ``step`` (1-based)."""
    return dict(run.steps[step - 1]["data"])
