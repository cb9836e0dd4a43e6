"""A tiny offline ``python -m verl.trainer.main_ppo`` on CPU: its inputs and the launch.

Everything is verl's own but generation (:mod:`.rollout`): a tiny Qwen2 built
from a config and a word-level tokenizer with a chat template (no hub), a parquet
dataset of letter prompts, a rule reward (the share of the response's letters among
:data:`GOOD`), GRPO with ``rollout.n=2`` and the KL loss on, 2 gloo ranks, verl's
file logger writing every step's metrics. The tests' ``main_ppo`` launch
(docs/frameworks/verl.md) and ``lossreduce bench --e2e``'s ``main_ppo`` step run it.
For CPU-only runs; it needs verl's environment (``lossreduce[verl]``) and pandas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lossreduce.trainer_worker.cpu_standins.verl.env import CPU_ENV, MEGATRON_MODULE, ROLLOUT_MODULE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TOKENS",
    "CPU_ACTOR_COUNTS",
    "CPU_LAUNCH_ENV",
    "EOS",
    "LOSSREDUCE",
    "PAD",
    "STEPS",
    "WORDS",
    "Inputs",
    "Launch",
    "critic_overrides",
    "engine_overrides",
    "launch_env",
    "logged_steps",
    "main_ppo_env",
    "overrides",
    "run_main_ppo",
    "save_model",
    "save_value_model",
    "tokenizer",
    "write_inputs",
]

PAD, EOS = 0, 1
WORDS = ["<pad>", "<eos>", *(chr(c) for c in range(ord("a"), ord("z") + 1))]
"""The tokenizer's word-level vocabulary: padding, end of sequence, the letters."""
CHAT_TOKENS = ["\n", "<|im_end|>"]
"""With ``chat=True``, after :data:`WORDS`: verl's agent loop builds Qwen2 chat turns
with a Qwen boundary builder, which needs ``"\n"`` to encode to exactly one id and
an ``<|im_end|>`` token (the whitespace pre-tokenizer alone drops newlines)."""

LOSSREDUCE = [
    "trainer.v1.trainer_mode=lossreduce",
    "+actor_rollout_ref.lossreduce.mode=prompt_mean",
    "+actor_rollout_ref.lossreduce.normalizer=coordinator",
]
"""The launch's lossreduce part: the trainer mode, the mode, and the job's own
coordinator actor (no address)."""
CPU_LAUNCH_ENV = {
    **CPU_ENV,
    "VERL_USE_EXTERNAL_MODULES": ",".join(
        [
            CPU_ENV["VERL_USE_EXTERNAL_MODULES"],
            ROLLOUT_MODULE,
        ]
    ),
}
"""What a CPU launch sets: verl's CPU platform and the CPU rollout, in every process."""
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

CPU_ACTOR_COUNTS = [
    # Each of verl's helper actors is a Ray worker process that imports verl and torch
    # (about 0.45 GB): its defaults, sized for a GPU node, start 8 TransferQueue storage
    # units (transfer_queue/storage/bootstrap/simple_storage_bootstrap.py) and 8 reward-loop
    # workers (verl/experimental/reward_loop/reward_loop.py): 29 ray:: processes and a
    # 12.8 GB peak (summed PSS) for one launch, which tripped Ray's memory monitor with two
    # launches at once on a 24 GB machine; with one of each, 15 and 6.4 GB, and about half
    # the wall time (72 s, not 150 s, on 2 cores). One of each serves a 4-prompt batch on 2 ranks; no number depends on the
    # count (a unit stores what the controller indexes; the rule reward scores each
    # response alone).
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "reward.num_workers=1",
]
"""The CPU launch's counts of verl's helper actors, the least a 2-rank launch needs (the
agent loop's, ``actor_rollout_ref.rollout.agent.num_workers=1``, is set for any launch)."""


def tokenizer(*, chat: bool = False) -> PreTrainedTokenizerFast:
    """The word-level tokenizer of :data:`WORDS` (and :data:`CHAT_TOKENS` with ``chat``)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if chat:
        # Added tokens are matched before pre-tokenization, so "\n" survives it.
        tok.add_tokens([AddedToken(CHAT_TOKENS[0], normalized=False)])
        tok.add_special_tokens([CHAT_TOKENS[1]])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def save_model(folder: Path, *, chat: bool = False) -> Path:
    """A tiny Qwen2 with seeded weights and its :func:`tokenizer`, saved to ``folder``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(WORDS) + (len(CHAT_TOKENS) if chat else 0),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer(chat=chat).save_pretrained(folder)
    return folder


def save_value_model(folder: Path, *, chat: bool = False) -> Path:
    """The tiny Qwen2 of :func:`save_model` with a value head (token classification, one
    label), seeded and saved whole, so verl's critic loads these exact weights."""
    import torch
    from transformers import Qwen2ForTokenClassification

    save_model(folder, chat=chat)
    config = Qwen2ForTokenClassification.config_class.from_pretrained(folder)
    config.num_labels = 1
    torch.manual_seed(1)
    Qwen2ForTokenClassification(config).save_pretrained(folder)
    return folder


@dataclass(frozen=True)
class Inputs:
    """Where a launch's inputs lie."""

    model: Path
    train: Path
    reward: Path
    value_model: Path | None = None
    """The critic's value model (:func:`save_value_model`), for PPO with a critic."""


def write_inputs(folder: Path, *, critic: bool = False) -> Inputs:
    """The model, chat tokenizer, dataset and reward function of a run, under ``folder``
    (with ``critic``, a value model too)."""
    import pandas as pd

    model = save_model(folder / "model", chat=True)
    tok = tokenizer(chat=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model)
    value_model = None
    if critic:
        value_model = save_value_model(folder / "value-model", chat=True)
        tok.save_pretrained(value_model)
    letters = WORDS[2:]
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
    return Inputs(model=model, train=train, reward=reward, value_model=value_model)


def engine_overrides(strategy: str = "fsdp2") -> list[str]:
    """The actor's and the reference policy's engine: verl's FSDP2 with eager attention
    on padded rows, or its Megatron engine (``strategy='megatron'``: verl's
    ``model_engine=megatron`` configs, packed rows, the model built through mbridge,
    which verl calls its legacy bridge: its default, Megatron-Bridge, imports Transformer
    Engine)."""
    if strategy == "megatron":
        return [
            "model_engine=megatron",
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
        ]
    return [
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        f"actor_rollout_ref.actor.strategy={strategy}",
    ]


def _fsdp_precision(strategy: str) -> list[str]:
    if strategy == "megatron":
        return []  # verl's Megatron engine trains bfloat16 parameters (fp32 optimizer state)
    return [
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
    ]


def overrides(
    inputs: Inputs,
    *,
    seed: int = 1,
    steps: int = STEPS,
    mini_batch_size: int = 2,
    cuda: bool = False,
    strategy: str = "fsdp2",
) -> list[str]:
    """The run's Hydra overrides (data, model, sizes) without the trainer mode: on 2 CPU
    ranks, or with ``cuda`` on one GPU (scripts/gpu_check.sh); the actor's engine is
    :func:`engine_overrides` of ``strategy``. With a value model in ``inputs``: PPO with a
    critic (GAE advantages) instead of GRPO."""
    return [
        "algorithm.adv_estimator=" + ("grpo" if inputs.value_model is None else "gae"),
        f"data.train_files={inputs.train}",
        f"data.val_files={inputs.train}",
        "data.train_batch_size=4",
        "data.max_prompt_length=8",
        "data.max_response_length=4",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={inputs.model}",
        *engine_overrides(strategy),
        # Prompts per mini-batch (optimizer step): 2, two mini-batches a training step.
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_size}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        *_fsdp_precision(strategy),
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
        *([] if inputs.value_model is None else critic_overrides(inputs.value_model)),
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
            # A Ray of its own even where another runs on the machine (ray.init() alone
            # would join the newest local cluster, and then refuse num_cpus).
            "+ray_kwargs.ray_init.address=local",
            *CPU_ACTOR_COUNTS,
        ]
    )


def critic_overrides(value_model: Path) -> list[str]:
    """The critic of PPO with GAE: the value model, FSDP2 in float32, eager attention,
    micro-batches of 2, as the actor's."""
    return [
        f"critic.model.path={value_model}",
        "critic.model.use_remove_padding=False",
        "+critic.model.override_config.attn_implementation=eager",
        "critic.strategy=fsdp2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.optim.lr=1e-2",
        "critic.fsdp.model_dtype=fp32",
    ]


def launch_env(*, cuda: bool = False, megatron: bool = False) -> dict[str, str]:
    """The environment a launch sets: the CPU rollout, and on CPU verl's CPU platform
    (and with ``megatron`` the stand-ins of verl's Megatron engine)."""
    if cuda:
        return {"VERL_USE_EXTERNAL_MODULES": ROLLOUT_MODULE}
    env = dict(CPU_LAUNCH_ENV)
    if megatron:
        env["VERL_USE_EXTERNAL_MODULES"] += f",{MEGATRON_MODULE}"
    return env


@dataclass(frozen=True)
class Launch:
    """How a ``main_ppo`` run ended: its exit code, its output, each step's logged record."""

    returncode: int
    output: str
    steps: list[dict[str, Any]]

    @property
    def logged(self) -> list[int]:
        """The steps verl's file logger wrote, in order."""
        return sorted(int(s["step"]) for s in self.steps)


def main_ppo_env(metrics: Path, *, cuda: bool = False, megatron: bool = False) -> dict[str, str]:
    """The environment of a ``main_ppo`` process: this one's, the launch's
    (:func:`launch_env`), quiet logs, no hub, and verl's file logger writing to ``metrics``.
    Without ``RAY_ADDRESS``: the launch starts a Ray of its own, as ``python -m
    verl.trainer.main_ppo`` does."""
    env = {
        **os.environ,
        **launch_env(cuda=cuda, megatron=megatron),
        "VERL_LOGGING_LEVEL": "ERROR",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "PYTHONWARNINGS": "ignore",
        "RAY_DEDUP_LOGS": "0",
    }
    if cuda:
        for key in ("VERL_PLATFORM", "VERL_ENGINE_DEVICE"):
            env.pop(key, None)
    env.pop("RAY_ADDRESS", None)
    return env


def logged_steps(metrics: Path) -> list[dict[str, Any]]:
    """Every record verl's file logger wrote to ``metrics`` (none if it never opened it)."""
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def run_main_ppo(
    folder: Path,
    args: list[str],
    timeout: float = 600,
    *,
    cuda: bool = False,
    megatron: bool = False,
) -> Launch:
    """``python -m verl.trainer.main_ppo *args`` in a fresh process (its own local Ray),
    in ``folder``, verl's file logger writing to ``folder/metrics.jsonl`` (``megatron``:
    with the stand-ins of verl's Megatron engine on CPU)."""
    metrics = folder / "metrics.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *args],
        cwd=folder,
        env=main_ppo_env(metrics, cuda=cuda, megatron=megatron),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Launch(done.returncode, done.stdout + done.stderr, logged_steps(metrics))
