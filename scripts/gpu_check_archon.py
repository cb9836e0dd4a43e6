"""AReaL's Archon engine on CUDA with its own attention: ``LossReducePPOTrainer`` vs ``PPOTrainer``.

Run by scripts/gpu_check.sh (``areal-archon-cuda``) with the AReaL environment's
Python on a machine with a GPU; it has not been run in this project (no GPU was
lent). On CPU the tests run Archon with ``sdpa`` attention
(``lossreduce.trainer_worker.cpu_standins.areal.archon``), because its default
``varlen`` attention is a flash-attention kernel with no CPU implementation; this
check runs that default. It launches ``grpo_launch.py`` the way
``test_areal_trainer_loop.py`` does, on one CUDA rank (``actor.backend=archon:d1``,
nccl, ``actor.archon.attn_type=varlen``), with the test's rollout server on CPU,
for 3 steps under SGD with clipping off and one sequence per micro-batch, once
with lossreduce (``token_mean``, torch normalizer) and once stock, and writes a
JSON summary to the path given: the weight versions the server received,
lossreduce's normalizers next to AReaL's token counts, both runs' first grad
norm, and the first update's difference relative to the update (expected below
1e-5). ``actor.pad_to_maximum`` stays on: without it Archon pads a micro-batch
to a 2 MiB page of activations, 32,768 tokens for the tiny test model, whose
padding positions run past its 64-position rope cache on any device.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.trainer_worker.integrations.areal import trainer_loop

OVERRIDES = (
    "actor.backend=archon:d1",
    "actor.archon.attn_type=varlen",
    "actor.pad_to_maximum=true",
    "actor.optimizer.type=sgd",
    "actor.optimizer.lr=0.1",
    "actor.optimizer.gradient_clipping=1.0e9",
    "actor.mb_spec.max_tokens_per_mb=7",
)


def logged(stdout: str, key: str) -> list[float]:
    """The values AReaL's stats table printed for ``key``, one per step."""
    return [float(v) for v in re.findall(rf"│ {re.escape(key)}\s+│\s*([0-9.e+-]+)", stdout)]


@dataclass
class Run:
    versions: list[int]  # weight versions the server loaded
    normalizers: list[float]  # lossreduce's pg normalizer per step (none when stock)
    n_valid_tokens: list[float]  # AReaL's own count per step
    grad_norm: list[float]  # AReaL's logged grad norm per step


def launch(stock: bool, work: Path, model: Path, prompts: Path) -> Run:
    run = trainer_loop.launch(
        stock,
        work,
        model=model,
        prompts=prompts,
        env={"LOSSREDUCE_MODE": "token_mean", "LOSSREDUCE_NORMALIZER": "torch"},
        ranks=1,
        overrides=OVERRIDES,
    )
    (work / "stdout.log").write_text(run.done.stdout + "\n" + run.done.stderr)
    if run.done.returncode != 0:
        name = "stock" if stock else "lossreduce"
        raise SystemExit(f"{name} run failed: {run.done.stderr[-3000:]}")
    out = run.done.stdout
    return Run(
        versions=run.server_log["versions"],
        normalizers=logged(out, "ppo_actor/update/lossreduce/normalizer/pg"),
        n_valid_tokens=logged(out, "ppo_actor/n_valid_tokens"),
        grad_norm=logged(out, "ppo_actor/update/grad_norm"),
    )


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    out = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        runs, relative = trainer_loop.first_update_ab(Path(tmp), launch)
    summary = {name: asdict(run) for name, run in runs.items()}
    out.write_text(json.dumps({**summary, "first_update_relative_difference": relative}, indent=2))
    ours_run, stock_run = runs["lossreduce"], runs["stock"]
    ok = (
        ours_run.versions == [1, 2, 3]
        and len(ours_run.normalizers) == 3
        and ours_run.normalizers == ours_run.n_valid_tokens
        # The grad norm as AReaL prints it: 5 significant digits.
        and abs(ours_run.grad_norm[0] - stock_run.grad_norm[0]) <= 1e-4 * stock_run.grad_norm[0]
        and relative < 1e-5
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
