"""What the trainer-loop tests (``test_areal_trainer_loop.py``, and
``megatron/test_megatron_trainer_loop.py``) launch, and the checks they share: a model
folder, a prompt file, the rollout server and ``torchrun`` over ``grpo_launch.py``
(stock or LossReduce).

Each launch is AReaL's SPMD mode as its local launcher sets it up
(``AREAL_SPMD_MODE=1``, ``AREAL_LLM_SERVER_ADDRS``), with ``torchrun`` run
directly because AReaL's launcher would also start a vLLM server.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tests.trainer_worker.integrations.areal import actor_checks
from tests.trainer_worker.integrations.areal.areal_runs import tiny_qwen2

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
LAUNCH = HERE / "grpo_launch.py"
CONFIG = HERE / "grpo_loop.yaml"
LETTERS = [chr(c) for c in range(ord("a"), ord("a") + 6)]
PROMPTS = 16
LOSSREDUCE_IMPORT = (
    "from lossreduce.trainer_worker.integrations.areal import LossReducePPOTrainer as PPOTrainer"
)
STOCK_IMPORT = "from areal import PPOTrainer"


def save_policy(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen2 with weights, and a word-level tokenizer with a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    words = ["<pad>", "<eos>", *LETTERS]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    # The prompt as it is: the word-level vocabulary has no chat markup.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(tiny_qwen2(len(words))).save_pretrained(folder)
    return folder


def save_prompts(path: Path) -> Path:
    """``PROMPTS`` chat prompts of three letters; the answer is the first."""
    rng = random.Random(7)
    with path.open("w") as out:
        for _ in range(PROMPTS):
            letters = rng.sample(LETTERS, 3)
            row = {
                "messages": [{"role": "user", "content": " ".join(letters)}],
                "answer": letters[0],
            }
            out.write(json.dumps(row) + "\n")
    return path


def save_inputs(folder: Path) -> tuple[Path, Path]:
    """A launch's policy (``folder/model``) and prompts (``folder/prompts.jsonl``)."""
    return save_policy(folder / "model"), save_prompts(folder / "prompts.jsonl")


def launch_script(folder: Path, stock: bool) -> Path:
    """``grpo_launch.py``, or the same with AReaL's own import back (stock AReaL)."""
    text = LAUNCH.read_text()
    assert LOSSREDUCE_IMPORT in text
    if stock:
        text = text.replace(LOSSREDUCE_IMPORT, STOCK_IMPORT)
    script = folder / ("grpo_stock.py" if stock else "grpo_lossreduce.py")
    script.write_text(text)
    return script


@dataclass
class RolloutServer:
    process: subprocess.Popen[bytes]
    address: str
    output: IO[bytes]

    def log(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.address}/test/log", timeout=30) as answer:
            result: dict[str, Any] = json.load(answer)
            return result

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.output.close()


def start_server(model: Path, port: int, seed: int, keep: Path, log: Path) -> RolloutServer:
    """The rollout server on ``port``, once it answers ``/health``; received weights go to ``keep``."""
    keep.mkdir(parents=True, exist_ok=True)
    output = log.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "rollout_server.py"),
            str(model),
            str(port),
            str(seed),
            str(keep),
        ],
        stdout=output,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    server = RolloutServer(process, f"127.0.0.1:{port}", output)
    # Generous: with the cores shared by other test jobs, importing torch alone has taken minutes.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output.close()
            raise RuntimeError(f"the rollout server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{server.address}/health", timeout=5):
                return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise RuntimeError("the rollout server did not answer /health within 300 s")


def torchrun_command(
    script: Path,
    work: Path,
    *,
    model: Path,
    prompts: Path,
    server: str,
    master_port: int,
    env: dict[str, str],
    ranks: int,
    overrides: tuple[str, ...],
    wrapper: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a ``torchrun`` of ``script`` on ``ranks`` ranks in
    AReaL's SPMD mode, run in ``work`` (its fileroot and name records go there); ``env``
    is added last. With a ``wrapper``, torchrun runs ``wrapper script ...`` (a rank's
    set-up before the script, e.g. a test platform)."""
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        *([str(wrapper)] if wrapper is not None else []),
        str(script),
        "--config",
        str(CONFIG),
        f"actor.path={model}",
        f"train_dataset.path={prompts}",
        f"cluster.fileroot={work / 'fileroot'}",
        f"cluster.name_resolve.nfs_record_root={work / 'name_resolve'}",
        *overrides,
    ]
    full_env = {
        **os.environ,
        "AREAL_SPMD_MODE": "1",
        "AREAL_LLM_SERVER_ADDRS": server,
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
        **env,
    }
    return args, full_env


def run_loop(
    script: Path,
    work: Path,
    *,
    model: Path,
    prompts: Path,
    server: str,
    master_port: int,
    env: dict[str, str],
    ranks: int = 2,
    overrides: tuple[str, ...] = (),
    timeout_s: float = 600,
    wrapper: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``torchrun`` of ``script`` on ``ranks`` ranks in AReaL's SPMD mode (``overrides``:
    more ``key=value`` options for AReaL's config, e.g. the actor's backend; ``wrapper``:
    see :func:`torchrun_command`)."""
    args, full_env = torchrun_command(
        script,
        work,
        model=model,
        prompts=prompts,
        server=server,
        master_port=master_port,
        env=env,
        ranks=ranks,
        overrides=overrides,
        wrapper=wrapper,
    )
    return subprocess.run(
        args, cwd=work, env=full_env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


@dataclass
class Launched:
    """One launch: torchrun's result, what the server served and the weights it received."""

    done: subprocess.CompletedProcess[str]
    server_log: dict[str, Any]
    weights: dict[int, dict[str, Any]]  # version -> state dict


def launch(
    stock: bool,
    work: Path,
    *,
    model: Path,
    prompts: Path,
    env: dict[str, str],
    ranks: int = 2,
    overrides: tuple[str, ...] = (),
    wrapper: Path | None = None,
) -> Launched:
    """``grpo_launch.py`` (stock or LossReduce) against a fresh rollout server, in ``work``
    (``wrapper``: see :func:`torchrun_command`)."""
    import torch

    from lossreduce.ports import free_port

    keep = work / "received"
    server = start_server(model, free_port(), 0, keep, work / "server.log")
    try:
        done = run_loop(
            launch_script(work, stock),
            work,
            model=model,
            prompts=prompts,
            server=server.address,
            master_port=free_port(),
            env=env,
            ranks=ranks,
            overrides=overrides,
            wrapper=wrapper,
        )
        log = server.log()
    finally:
        server.stop()
    weights = {
        int(p.stem[1:]): torch.load(p, weights_only=True) for p in sorted(keep.glob("v*.pt"))
    }
    return Launched(done, log, weights)


def first_update_ab(root: Path, launch_one: Any) -> tuple[dict[str, Any], float]:
    """The GPU checks' A/B: a policy and prompts under ``root``, ``launch_one(stock, work,
    model, prompts)`` once with lossreduce and once stock, and the first update's
    difference between the two relative to the update (weights the server received)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = save_policy(root / "model")
    prompts = save_prompts(root / "prompts.jsonl")
    runs: dict[str, Any] = {}
    for name in ("lossreduce", "stock"):
        (root / name).mkdir()
        runs[name] = launch_one(name == "stock", root / name, model, prompts)
    ours = torch.load(root / "lossreduce" / "received" / "v1.pt")
    theirs = torch.load(root / "stock" / "received" / "v1.pt")
    start = AutoModelForCausalLM.from_pretrained(model).state_dict()
    return runs, actor_checks.relative(ours, theirs, start)


# -- the checks every engine's trainer loop runs -------------------------------------------------

STEPS = 3  # grpo_loop.yaml's total_train_steps
BATCH = 4  # prompts per step (train_dataset.batch_size)
SAMPLES = 2  # gconfig.n_samples
JOB = "areal-loop"
SGD_LR = 0.1
AB_OVERRIDES = (
    "actor.optimizer.gradient_clipping=1.0e9",  # never reached: clipping off
    # A prompt is 3 tokens and a response 1 to 4, so two sequences never fit in 7.
    "actor.mb_spec.max_tokens_per_mb=7",
)
"""The A/B's options besides the optimizer (each engine's SGD): clipping off, and one
sequence per micro-batch, because on CPU packed micro-batches make stock AReaL differ
from itself."""


@dataclass
class LoopRun:
    """One launch as the checks see it."""

    stdout: str
    server_log: dict[str, Any]
    weights: dict[int, dict[str, Any]]  # version -> what the server received
    rounds: list[Any]  # the coordinator's rounds of the job (LossReduce only)

    def logged(self, key: str) -> list[float]:
        """Every value AReaL's stats table printed for ``key`` (one per step), as printed
        (``.4e``: 5 significant digits)."""
        pattern = rf"│ {re.escape(key)}\s+│\s*([0-9.e+-]+|nan|inf)"
        return [float(v) for v in re.findall(pattern, self.stdout)]


def _checked_launch(
    stock: bool,
    policy: tuple[Path, Path],
    work: Path,
    *,
    env: dict[str, str],
    overrides: tuple[str, ...],
    wrapper: Path | None,
) -> Launched:
    model, prompts = policy
    run = launch(
        stock, work, model=model, prompts=prompts, env=env, overrides=overrides, wrapper=wrapper
    )
    assert run.done.returncode == 0, f"{run.done.stdout[-4000:]}\n{run.done.stderr[-6000:]}"
    return run


def lossreduce_loop(
    policy: tuple[Path, Path],
    work: Path,
    overrides: tuple[str, ...],
    wrapper: Path | None = None,
) -> LoopRun:
    """``grpo_launch.py`` for ``STEPS`` steps, ``token_mean`` with the normalizers from a
    coordinator of its own (``policy``: the model folder and the prompt file)."""
    from lossreduce.server import CoordinatorSettings, CoordinatorThread
    from tests.conftest import TEST_SETTINGS

    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    try:
        env = {
            "LOSSREDUCE_MODE": "token_mean",
            "LOSSREDUCE_NORMALIZER": "coordinator",
            "LOSSREDUCE_COORDINATOR": thread.target,
            "LOSSREDUCE_JOB": JOB,
        }
        run = _checked_launch(False, policy, work, env=env, overrides=overrides, wrapper=wrapper)
        rounds = list(thread.coordinator.table.rounds(JOB))
    finally:
        thread.stop()
    return LoopRun(run.done.stdout, run.server_log, run.weights, rounds)


def stock_loop(
    policy: tuple[Path, Path],
    work: Path,
    overrides: tuple[str, ...],
    wrapper: Path | None = None,
) -> LoopRun:
    """The same launch with AReaL's own ``PPOTrainer``, for one step: the comparison
    needs the first update only."""
    run = _checked_launch(
        True, policy, work, env={}, overrides=(*overrides, "total_train_steps=1"), wrapper=wrapper
    )
    return LoopRun(run.done.stdout, run.server_log, run.weights, [])


def _normalizers(rnd: Any) -> dict[str, float]:
    return {v.term: v.value for v in rnd.outcome.normalizers}


def check_loop_ran(run: LoopRun) -> None:
    """AReaL's loop finished its ``STEPS`` steps against the rollout server."""
    assert "Training completes" in run.stdout
    log = run.server_log
    # Every step's responses came from the server, and every step's weights went back.
    # AReaL's rollout may start the next step's prompts before the run ends.
    assert STEPS * BATCH * SAMPLES <= log["completions"] <= (STEPS + 1) * BATCH * SAMPLES
    assert log["versions"] == list(range(1, STEPS + 1))
    assert log["paused"] == STEPS
    assert log["unknown"] == []


def check_rounds_are_areals_counts(run: LoopRun, rounds_per_version: int | None) -> None:
    """One coordinator round per update, each normalizing by AReaL's own counts of its step.

    ``rounds_per_version`` is the actor's ``ROUNDS_PER_VERSION``; ``None`` where the test
    process does not import AReaL (the Megatron environment's AReaL and Megatron-Core
    warn on import), and then the rounds need only be numbered at one spacing from 0.
    """
    rounds = sorted(run.rounds, key=lambda r: r.key.step)
    steps = [r.key.step for r in rounds]
    if rounds_per_version is not None:
        spacing = rounds_per_version
    else:
        spacing = steps[1] if len(steps) > 1 else 0
    # One round per update, numbered from the weight version it trained (so a
    # resumed run continues where its checkpoint left off).
    assert spacing > 0, steps
    assert steps == [v * spacing for v in range(STEPS)]
    for rnd in rounds:
        assert rnd.outcome is not None
        assert rnd.outcome.kind == "completed"
    # token_mean's pg is the step's active tokens over both ranks, and rows its
    # sequences: AReaL's own n_valid_tokens and n_seqs of the same step.
    assert [_normalizers(r)["pg"] for r in rounds] == run.logged("ppo_actor/n_valid_tokens")
    assert [_normalizers(r)["rows"] for r in rounds] == run.logged("ppo_actor/n_seqs")
    assert run.logged("ppo_actor/n_seqs") == [BATCH * SAMPLES] * STEPS
    # The same normalizers in AReaL's own stats, once per step.
    assert run.logged("ppo_actor/update/lossreduce/normalizer/pg") == [
        _normalizers(r)["pg"] for r in rounds
    ]


def check_first_update(
    ours: LoopRun, theirs: LoopRun, model: Path, tolerance: float
) -> tuple[float, float]:
    """The first update (the weights the server received) equal to stock AReaL's within
    ``tolerance`` relative to the update, with the same logged grad norm and token count;
    returns the relative difference and the update's norm."""
    import pytest
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(model).state_dict())
    first, stock = ours.weights[1], theirs.weights[1]
    assert sorted(first) == sorted(stock) == sorted(start)
    relative = actor_checks.relative(first, stock, start)  # asserts the step moved them
    print(f"first SGD update, lossreduce against stock: relative {relative:.1e}")
    assert relative < tolerance
    assert theirs.server_log["versions"] == [1]
    # The same step's gradient norm (as AReaL prints it) and the same token count.
    (stock_norm,) = theirs.logged("ppo_actor/update/grad_norm")
    assert stock_norm > 0
    assert ours.logged("ppo_actor/update/grad_norm")[0] == pytest.approx(stock_norm, rel=1e-4)
    assert (
        ours.logged("ppo_actor/n_valid_tokens")[0] == theirs.logged("ppo_actor/n_valid_tokens")[0]
    )
    moved = sum(float((stock[n].double() - start[n].double()).pow(2).sum()) for n in start)
    return relative, moved**0.5
