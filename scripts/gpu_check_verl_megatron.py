"""verl's Megatron engine on CUDA: ``LossReduceTrainingWorker`` vs stock, and context parallel 2.

Run by scripts/gpu_check.sh (``verl-megatron-cuda``) with the Python of a verl Megatron
environment with CUDA (VERL_MEGATRON_PYTHON: verl 0.9.1, Megatron-Core and, for the
context-parallel part, Transformer Engine; e.g. verl's own Megatron image with
``pip install 'lossreduce[verl]'``) on a machine with a GPU; it has not been run in this
project (no GPU was lent). It runs the CPU tests' cases
(tests/trainer_worker/integrations/verl/megatron) on CUDA with nccl and no CPU stand-in:
Megatron-Bridge (verl's default) where it is installed, else mbridge; Transformer
Engine's layer spec where TE is installed.

- ``dp1``: one GPU; every mode against the formulas of docs/reduction-semantics.md and
  ``token_mean`` against stock ``TrainingWorker`` (``token-mean``), SGD's step, clipping
  off;
- ``cp2``: context parallel 2 on two GPUs (only where two are visible and TE is
  installed; the CPU tests show Megatron-Core's local attention refusing it): the update
  against ``dp1``'s and the formula's, each context-parallel rank counting the whole
  sequences of its data-parallel rank (the same normalizers as ``dp1``) in a round of its
  own (``actor.cp0``, ``actor.cp1``).

Writes a JSON summary to the path given and exits non-zero when an update is off by more
than 1e-4 relative to the update (float32 on GPU kernels).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lossreduce.ports import free_port
from tests.trainer_worker.integrations.verl import tiny_verl
from tests.trainer_worker.integrations.verl.megatron import megatron_runs
from tests.trainer_worker.integrations.verl.megatron.megatron_runs import MegatronCase
from tests.trainer_worker.integrations.verl.test_verl_worker import MODES, reference_update
from tests.trainer_worker.integrations.verl.verl_runs import relative

TOLERANCE = 1e-4


def _run(layout: str, cases: list[MegatronCase], folder: Path, model: Path) -> list[Any]:
    job = megatron_runs.Job(
        layout, cases, str(model), str(folder / layout), free_port(), device="cuda"
    )
    return megatron_runs.run(job)


def main(out: str) -> int:
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "megatron_bridge": importlib.util.find_spec("megatron.bridge") is not None,
    }
    failed = False
    with tempfile.TemporaryDirectory(prefix="lossreduce-verl-megatron-gpu-") as scratch:
        folder = Path(scratch)
        model = megatron_runs.save_model(folder / "model")
        cases = [MegatronCase(f"{m}-dp1", mode=m, divisor=d, micro=4) for m, d in MODES.items()]
        cases.append(MegatronCase("verl-dp1", worker="verl", micro=4))
        (dp1,) = _run("dp1", cases, folder, model)
        for mode in MODES:
            got = dp1[f"{mode}-dp1"]
            if "update" not in got:
                summary[f"{mode}-dp1"] = {"error": str(got)[-2000:]}
                failed = True
                continue
            diff = relative(got["update"], reference_update(model, tiny_verl.rows(), mode))
            summary[f"{mode}-dp1"] = {
                "relative_to_formula": diff,
                "normalizers": got["normalizers"],
            }
            failed |= diff > TOLERANCE
        stock = dp1["verl-dp1"]
        ab = relative(dp1["token_mean-dp1"]["update"], stock["update"])
        counts = sorted({c["batch_num_tokens"] for c in stock["verl_counts"]})
        summary["token_mean-vs-stock"] = {"relative": ab, "verl_batch_num_tokens": counts}
        failed |= ab > TOLERANCE or counts != [dp1["token_mean-dp1"]["normalizers"]["pg"]]
        if summary["gpus"] >= 2 and summary["transformer_engine"]:
            cp2 = _run("cp2", [MegatronCase("token_mean-cp2")], folder, model)
            want = dp1["token_mean-dp1"]
            for rank, result in enumerate(cp2):
                got = result["token_mean-cp2"]
                if "update" not in got:
                    summary[f"cp2-rank{rank}"] = {"error": str(got)[-2000:]}
                    failed = True
                    continue
                diff = relative(got["update"], want["update"])
                summary[f"cp2-rank{rank}"] = {
                    "relative_to_dp1": diff,
                    "normalizers": got["normalizers"],
                    "group": got.get("group"),
                }
                failed |= diff > TOLERANCE or got["normalizers"] != want["normalizers"]
        else:
            summary["cp2"] = "skipped: needs two GPUs and Transformer Engine"
    Path(out).write_text(json.dumps(summary, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
