"""AReaL's trainer loop on CUDA: ``LossReducePPOTrainer`` vs AReaL's ``PPOTrainer``.

Run by scripts/gpu_check.sh (``areal-loop-cuda``) with the AReaL environment's
Python (``AREAL_PYTHON``, default ``.venv-areal/bin/python``) on a machine with
a GPU; it has not been run in this project (no GPU was lent). It launches
``grpo_launch.py`` the way ``test_areal_trainer_loop.py`` does, on one CUDA rank
(``actor.backend=fsdp:d1``, nccl), with the test's rollout server on CPU, for 3
steps, once with lossreduce (``token_mean``, torch normalizer) and once stock,
and writes a JSON summary to the path given: the weight versions the server
received, lossreduce's logged normalizers, and the first update's relative
difference between the two, relative to the update (expected below 1e-5).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.trainer_worker.integrations.areal import trainer_loop


def launch(stock: bool, work: Path, model: Path, prompts: Path) -> dict[str, object]:
    run = trainer_loop.launch(
        stock,
        work,
        model=model,
        prompts=prompts,
        env={"LOSSREDUCE_MODE": "token_mean", "LOSSREDUCE_NORMALIZER": "torch"},
        ranks=1,
        overrides=("actor.backend=fsdp:d1",),
    )
    (work / "stdout.log").write_text(run.done.stdout + "\n" + run.done.stderr)
    if run.done.returncode != 0:
        name = "stock" if stock else "lossreduce"
        raise SystemExit(f"{name} run failed: {run.done.stderr[-3000:]}")
    logged = re.findall(r"lossreduce/normalizer/pg\s*│\s*([0-9.e+-]+)", run.done.stdout)
    return {"versions": run.server_log["versions"], "normalizers": [float(v) for v in logged]}


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    out = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        runs, relative = trainer_loop.first_update_ab(Path(tmp), launch)
    summary = {**runs, "first_update_relative_difference": relative}
    out.write_text(json.dumps(summary, indent=2))
    ok = (
        runs["lossreduce"]["versions"] == [1, 2, 3]
        and len(runs["lossreduce"]["normalizers"]) == 3
        and summary["first_update_relative_difference"] < 1e-5
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
