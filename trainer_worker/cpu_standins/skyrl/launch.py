"""A tiny offline ``python -m skyrl.train.entrypoints.main_base`` on CPU: inputs and launch.

Everything is SkyRL's own but the device and generation: its ``main_base`` entrypoint
(dispatching to lossreduce's with ``trainer.override_entrypoint``), its trainer, its
data loader, its generator and environment loop, GRPO's advantages, the reference
policy, the FSDP policy update and its checkpoints. What stands in:

- the device: :mod:`.platform` in every Ray worker process (``RAY_RUNTIME_ENV_HOOK``
  adds :func:`worker_setup` as the job's ``worker_process_setup_hook``), on a fresh
  local Ray cluster with 4 CPU "GPUs" (``RAY_ADDRESS=local``,
  ``RAY_OVERRIDE_RESOURCES``): 2 policy ranks and 2 reference ranks over gloo;
- the prompt filter's 8 spawned processes: the same filter in the process that loads the
  prompts (:func:`_filter_in_process`);
- generation: the stand-in server of :mod:`.inference` (HF sampling), given to SkyRL
  as an external vLLM server, and its weight sender in place of vLLM's NCCL engine;
- the task: a tiny Qwen2 built from a config, a word-level tokenizer with a chat
  template made here (no hub), a parquet dataset of letter prompts, and a SkyRL-gym
  environment (:mod:`.letters_env`) whose reward is the share of the response's
  letters among :data:`GOOD`.

Metrics go to SkyRL's tensorboard logger (``TENSORBOARD_DIR``), read back by
:func:`logged_steps`. For CPU runs and tests only; it needs SkyRL's environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "ENV",
    "GOOD",
    "LOSSREDUCE",
    "STEPS",
    "WORDS",
    "Inputs",
    "launch_env",
    "logged_steps",
    "main_base_command",
    "overrides",
    "run_main_base",
    "runtime_env_hook",
    "save_model",
    "standin_server",
    "tokenizer",
    "worker_setup",
    "write_inputs",
]

WORDS = ["<pad>", "<eos>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "<|im_end|>"]
"""The tokenizer's word-level vocabulary: padding, end of sequence, the letters, and a
chat end-of-turn token."""
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)
GOOD = "abcdefghijklm"
"""The reward: the share of the response's letters among these (a dense score, so
GRPO's advantages are not all zero)."""
ENV = "lossreduce_letters"
"""The SkyRL-gym environment id of :class:`.letters_env.LettersEnv`."""
PROMPTS = 12
"""Three steps of 4 prompts in one epoch (a checkpoint at an epoch's end resumes with an
exhausted data loader in SkyRL 0.4, which trains nothing more in that epoch)."""
STEPS = 3
LOSSREDUCE = [
    "trainer.override_entrypoint=lossreduce.trainer_worker.integrations.skyrl.entrypoint",
    "trainer.lossreduce.mode=prompt_mean",
    "trainer.lossreduce.normalizer=coordinator",
]
"""The launch's lossreduce part: the entrypoint, the mode, and the job's own
coordinator actor (no address)."""
WEIGHT_SENDERS = "skyrl.backends.skyrl_train.weight_sync.weight_senders"
PROMPT_DATASET = "skyrl.train.dataset.dataset"
SETUP_HOOK = "lossreduce.trainer_worker.cpu_standins.skyrl.launch.worker_setup"
RUNTIME_ENV_HOOK = "lossreduce.trainer_worker.cpu_standins.skyrl.launch.runtime_env_hook"


def tokenizer() -> Any:
    """The word-level tokenizer of :data:`WORDS` with :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<eos>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_model(folder: Path) -> Path:
    """A tiny Qwen2 with seeded weights and its :func:`tokenizer`, saved to ``folder``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


@dataclass(frozen=True)
class Inputs:
    """Where a launch's inputs lie."""

    model: Path
    train: Path


def write_inputs(folder: Path, prompts: int = PROMPTS) -> Inputs:
    """The model, tokenizer and dataset of a run, under ``folder``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = save_model(folder / "model")
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    rows = [
        {
            "prompt": [{"role": "user", "content": " ".join(letters[i % 26 : i % 26 + 3])}],
            "env_class": ENV,
            "reward_spec": {"ground_truth": GOOD},
            "data_source": "letters",
        }
        for i in range(prompts)
    ]
    train = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    return Inputs(model=model, train=train)


# -- every worker process -----------------------------------------------------------------


def worker_setup() -> None:
    """What every Ray worker process of a CPU launch runs first: the CPU platform, the
    stand-in weight sender in place of vLLM's engine, and the environment."""
    from lossreduce.trainer_worker.cpu_standins.skyrl.platform import after_import, install

    install()
    # Each where it is imported: most of a Ray job's workers import neither.
    after_import(WEIGHT_SENDERS, _standin_weight_sender)
    after_import("skyrl_gym", _register_letters_env)
    after_import(PROMPT_DATASET, _filter_in_process)


def _standin_weight_sender(weight_senders: Any) -> None:
    from lossreduce.trainer_worker.cpu_standins.skyrl.inference import standin_trainer_engine

    weight_senders.build_trainer_engine = standin_trainer_engine


def _filter_in_process(dataset: Any) -> None:
    # main_base filters the prompts by length with 8 spawned processes (num_workers=8,
    # hard-coded): on a 2-core machine, 25 s and 48 CPU-seconds of every launch for 12
    # prompts. The filter keeps the same rows in one process.
    prompts = dataset.PromptDataset
    read = prompts._read_files_and_tokenize

    def read_in_process(self: Any) -> None:
        self.num_workers = 1
        read(self)

    prompts._read_files_and_tokenize = read_in_process


def _register_letters_env(_: Any) -> None:
    from lossreduce.trainer_worker.cpu_standins.skyrl import letters_env

    letters_env.register()


def runtime_env_hook(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: the job's runtime env with :func:`worker_setup`
    as its ``worker_process_setup_hook``."""
    env = dict(runtime_env or {})
    given = env.get("worker_process_setup_hook")
    if given not in (None, SETUP_HOOK):
        raise ValueError(
            f"runtime_env already names a worker_process_setup_hook ({given!r}); the CPU "
            f"launch needs its own ({SETUP_HOOK!r})"
        )
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


# -- the launch ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def standin_server(model: Path, log: Path, seed: int = 1) -> Iterator[str]:
    """The stand-in inference server (:mod:`.inference`) on a free loopback port, for as
    long as the block runs: its URL."""
    port = _free_port()
    with log.open("ab") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lossreduce.trainer_worker.cpu_standins.skyrl.inference",
                f"--model={model}",
                f"--port={port}",
                f"--seed={seed}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url, server)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_for(url: str, server: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the stand-in inference server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise TimeoutError(f"the stand-in inference server at {url} did not start in {timeout_s} s")


def launch_env(tensorboard: Path) -> dict[str, str]:
    """The environment of a CPU launch: a fresh local Ray cluster with 4 CPU "GPUs",
    the CPU worker setup in every Ray worker, SkyRL's tensorboard log in ``tensorboard``."""
    return {
        **os.environ,
        "RAY_ADDRESS": "local",
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 16, "GPU": 4}),
        "RAY_RUNTIME_ENV_HOOK": RUNTIME_ENV_HOOK,
        "TENSORBOARD_DIR": str(tensorboard),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


def overrides(
    work: Path, inputs: Inputs, server: str, *, steps: int = STEPS, mini_batches: int = 1
) -> list[str]:
    """SkyRL's arguments for 2 policy ranks: GRPO, 4 prompts x 2 responses a step, the KL
    and entropy losses on, float32, a checkpoint every step, ``steps`` steps."""
    mini_batch = 4 // mini_batches
    return [
        "trainer.strategy=fsdp",
        f"trainer.policy.model.path={inputs.model}",
        f"trainer.ref.model.path={inputs.model}",
        f"data.train_data=['{inputs.train}']",
        f"data.val_data=['{inputs.train}']",
        "data.dataloader.num_workers=0",
        f"environment.env_class={ENV}",
        "trainer.algorithm.advantage_estimator=grpo",
        "trainer.algorithm.use_kl_loss=true",
        "trainer.algorithm.kl_loss_coef=0.1",
        "trainer.algorithm.use_entropy_loss=true",
        "trainer.algorithm.entropy_loss_coef=0.01",
        "trainer.placement.colocate_all=false",
        "trainer.placement.colocate_policy_ref=false",
        # Two "nodes" of one CPU "GPU" each: SkyRL then skips its GPU peer-access probe
        # (a Ray start of its own on a CPU head node); Ray places both on this node.
        "trainer.placement.policy_num_nodes=2",
        "trainer.placement.policy_num_gpus_per_node=1",
        "trainer.placement.ref_num_nodes=2",
        "trainer.placement.ref_num_gpus_per_node=1",
        "trainer.flash_attn=false",
        "trainer.remove_microbatch_padding=false",
        "trainer.gradient_checkpointing=false",
        "trainer.policy.fsdp_config.mixed_precision.param_dtype=fp32",
        "trainer.ref.fsdp_config.mixed_precision.param_dtype=fp32",
        "trainer.policy.optimizer_config.lr=0.01",
        "trainer.policy.optimizer_config.offload_after_step=false",
        "trainer.train_batch_size=4",
        f"trainer.policy_mini_batch_size={mini_batch}",
        "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.max_prompt_length=16",
        "generator.n_samples_per_prompt=2",
        "generator.sampling_params.max_generate_length=4",
        "generator.eval_sampling_params.max_generate_length=4",
        "generator.inference_engine.run_engines_locally=false",
        f"generator.inference_engine.external_proxy_url={server}",
        f"generator.inference_engine.external_server_urls=['{server}']",
        "generator.inference_engine.model_dtype=float32",
        "trainer.epochs=1",
        f"trainer.max_training_steps={steps}",
        "trainer.eval_interval=-1",
        "trainer.eval_before_train=false",
        "trainer.ckpt_interval=1",
        f"trainer.ckpt_path={work / 'ckpt'}",
        f"trainer.export_path={work / 'export'}",
        f"trainer.log_path={work / 'logs'}",
        "trainer.dump_data_batch=true",
        "trainer.logger=tensorboard",
        "trainer.project_name=lossreduce-test",
        "trainer.run_name=cpu",
        "trainer.seed=1",
        "trainer.resume_mode=none",
    ]


def main_base_command(args: Sequence[str]) -> list[str]:
    """``python -m skyrl.train.entrypoints.main_base ARGS`` with this interpreter."""
    return [sys.executable, "-m", "skyrl.train.entrypoints.main_base", *args]


def run_main_base(
    args: Sequence[str], work: Path, *, timeout_s: float = 900.0
) -> subprocess.CompletedProcess[str]:
    """:func:`main_base_command` with :func:`launch_env` (tensorboard log in
    ``work/tensorboard``), run to its end."""
    return subprocess.run(
        main_base_command(args),
        env=launch_env(work / "tensorboard"),
        cwd=work,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def logged_steps(tensorboard: Path) -> dict[int, dict[str, float]]:
    """Every step's scalars from SkyRL's tensorboard log in ``tensorboard`` (the last
    value logged for a step and key wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: dict[int, dict[str, float]] = defaultdict(dict)
    for events in sorted(tensorboard.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            for event in accumulator.Scalars(tag):
                steps[event.step][tag] = event.value
    return dict(steps)
