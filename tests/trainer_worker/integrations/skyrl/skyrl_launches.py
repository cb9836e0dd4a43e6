"""SkyRL's own ``main_base`` launches the tests run, on CPU (:mod:`...cpu_standins.skyrl.launch`).

A launch runs in a folder of its own (its checkpoints, exported models, dumped
batches and logs; a relaunch reuses its folder's checkpoints and logs to a second
tensorboard folder) against the module's stand-in inference server, in a process
group of its own (:class:`tests.launch_group.GroupLaunch`). With ``critic=True`` it
trains PPO with GAE and SkyRL's critic (:func:`critic_args`): 2 critic ranks of their
own besides the 2 policy and 2 reference ranks, on 6 CPU "GPUs".
"""

from __future__ import annotations

import json
import pickle
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lossreduce.trainer_worker.cpu_standins.skyrl import launch
from tests.launch_group import GroupLaunch

__all__ = [
    "CLAIMED",
    "LAUNCH_TIMEOUT_S",
    "Launched",
    "critic_args",
    "critic_model",
    "dumped_batches",
    "exported_weights",
    "finished",
    "start",
    "wait_for_checkpoint",
]

LAUNCH_TIMEOUT_S = 600.0
CLAIMED = re.compile(
    r"lossreduce: run '(?P<run>[^']+)' claimed job '(?P<job>[^']+)' group '(?P<group>[^']+)' "
    r"from round (?P<step>\d+)"
)
"""A line the trainer logs once its policy (or critic) workers have claimed the run's group."""


@dataclass(frozen=True)
class Launched:
    """A finished launch: its exit status, output and every logged step's scalars."""

    name: str
    returncode: int
    output: str
    steps: dict[int, dict[str, float]]
    work: Path

    def check(self) -> Launched:
        assert self.returncode == 0, f"{self.name} exited {self.returncode}:\n{self.output[-8000:]}"
        return self


def critic_model(inputs: launch.Inputs) -> Path:
    """The critic's model: the launch's tiny Qwen2 with tied embeddings, next to it
    (written once). SkyRL 0.4.0 builds an untied critic on every rank but the first from
    ``transformers.modeling_utils.no_init_weights``, which transformers 5.16.1 no longer
    has, so stock SkyRL's critic on two ranks fails at start with the untied model
    (docs/frameworks/skyrl.md)."""
    from transformers import Qwen2ForCausalLM

    folder = Path(inputs.model).parent / "critic-model"
    if not (folder / "config.json").exists():
        model = Qwen2ForCausalLM.from_pretrained(inputs.model)
        model.config.tie_word_embeddings = True
        model.save_pretrained(folder)
    return folder


def critic_args(inputs: launch.Inputs) -> list[str]:
    """PPO with GAE and SkyRL's critic (:func:`critic_model` with a value head), on 2 ranks
    of its own, float32, one critic mini-batch a step, its value loss in ``prompt_mean``
    (each row's prompt group reaches the critic too)."""
    return [
        "trainer.algorithm.advantage_estimator=gae",
        f"trainer.critic.model.path={critic_model(inputs)}",
        "trainer.placement.critic_num_nodes=2",
        "trainer.placement.critic_num_gpus_per_node=1",
        "trainer.critic.fsdp_config.mixed_precision.param_dtype=fp32",
        "trainer.critic.optimizer_config.lr=0.01",
        "trainer.critic.optimizer_config.offload_after_step=false",
        "trainer.critic_mini_batch_size=4",
        "trainer.lossreduce.critic_mode=prompt_mean",
    ]


def start(
    name: str,
    work: Path,
    inputs: launch.Inputs,
    server: str,
    extra: list[str],
    *,
    steps: int,
    critic: bool = False,
) -> GroupLaunch:
    """``main_base`` with lossreduce's entrypoint and ``extra`` (which win), in the
    background; its tensorboard log goes to ``work/<name>-tensorboard``. ``critic``: with
    GAE and the critic (:func:`critic_args`)."""
    work.mkdir(parents=True, exist_ok=True)
    with_critic = critic_args(inputs) if critic else []
    args = [
        *launch.LOSSREDUCE,
        *launch.overrides(work, inputs, server, steps=steps),
        *with_critic,
        *extra,
    ]
    env = launch.launch_env(work / f"{name}-tensorboard")
    if critic:
        # The critic's 2 ranks need 2 more CPU "GPUs" than the policy's and the reference's.
        env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": 16, "GPU": 6})
    return GroupLaunch.start(
        name,
        launch.main_base_command(args),
        env=env,
        cwd=work,
        log=work / f"{name}.log",
    )


def finished(running: GroupLaunch, work: Path, timeout: float = LAUNCH_TIMEOUT_S) -> Launched:
    """Wait for ``running`` to end; what it did."""
    code = running.wait(timeout)
    steps = launch.logged_steps(work / f"{running.name}-tensorboard")
    return Launched(running.name, code, running.output(), steps, work)


def wait_for_checkpoint(running: GroupLaunch, work: Path, step: int, timeout: float) -> None:
    """Return as soon as SkyRL's tracker names checkpoint ``step`` (it writes it last,
    after the whole checkpoint): the driver is between steps then."""
    tracker = work / "ckpt" / "latest_ckpt_global_step.txt"
    deadline = time.monotonic() + timeout
    while True:
        text = tracker.read_text().strip() if tracker.exists() else ""
        if text and int(text) >= step:
            assert int(text) == step, f"{running.name}: checkpoint {text} already, not {step}"
            return
        running.check_running(f"checkpoint {step}")
        assert time.monotonic() < deadline, f"{running.name}: no checkpoint {step} in {timeout} s"
        time.sleep(0.05)


def dumped_batches(work: Path) -> dict[int, Any]:
    """The training batch SkyRL dumped at each step (``trainer.dump_data_batch``), before
    its policy update: step -> ``TrainingInputBatch``."""
    out = {}
    for path in (work / "export" / "dumped_data").glob("global_step_*_training_input.pkl"):
        with path.open("rb") as f:
            out[int(path.name.split("_")[2])] = pickle.load(f)
    return out


def exported_weights(work: Path, step: int, model: str = "policy") -> dict[str, torch.Tensor]:
    """The ``model`` (``policy`` or ``critic``) SkyRL exported after ``step``
    (``trainer.hf_save_interval``)."""
    from safetensors.torch import load_file

    folder = work / "export" / f"global_step_{step}" / model
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(path))
    assert weights, f"no exported weights in {folder}"
    return weights
