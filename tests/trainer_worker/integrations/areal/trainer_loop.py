"""What ``test_areal_trainer_loop.py`` launches: a model folder, a prompt file, the rollout
server and ``torchrun`` over ``grpo_launch.py`` (stock or LossReduce).

Each launch is AReaL's SPMD mode as its local launcher sets it up
(``AREAL_SPMD_MODE=1``, ``AREAL_LLM_SERVER_ADDRS``), with ``torchrun`` run
directly because AReaL's launcher would also start a vLLM server.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

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
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a ``torchrun`` of ``script`` on ``ranks`` ranks in
    AReaL's SPMD mode, run in ``work`` (its fileroot and name records go there); ``env``
    is added last."""
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
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
) -> subprocess.CompletedProcess[str]:
    """``torchrun`` of ``script`` on ``ranks`` ranks in AReaL's SPMD mode (``overrides``:
    more ``key=value`` options for AReaL's config, e.g. the actor's backend)."""
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
) -> Launched:
    """``grpo_launch.py`` (stock or LossReduce) against a fresh rollout server, in ``work``."""
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
    diff = sum(float((ours[n].double() - theirs[n].double()).pow(2).sum()) for n in ours)
    moved = sum(float((theirs[n].double() - start[n].double()).pow(2).sum()) for n in ours)
    return runs, (diff / moved) ** 0.5
