"""AReaL's Megatron engine on CUDA: ``lossreduce_actor(MegatronPPOActor)`` vs stock.

Run by scripts/gpu_check.sh (``areal-megatron-cuda``) with the Megatron environment's
Python (``.venv-megatron``: AReaL 1.0.4's ``[megatron]`` extra on Python 3.12) on a
machine with a GPU; it has not been run in this project (no GPU was lent). It runs
the CPU tests' cases (tests/trainer_worker/integrations/areal/megatron) on CUDA with
nccl and the version fixes of ``megatron_compat`` only, no CPU platform: Transformer
Engine's layer spec and varlen attention where TE is installed, Megatron-Core's local
modules (``cpu_decoder_block_spec`` of
``lossreduce.trainer_worker.cpu_standins.megatron.platform``) where it is not.

- ``dp1``: one GPU; every mode, ``token_mean`` against stock ``MegatronPPOActor``
  (SGD's step, clipping off), each compared with the formulas of
  docs/reduction-semantics.md;
- ``cp2``: context parallel 2 on two GPUs (only where two are visible and TE is
  installed; the CPU tests show Megatron-Core's local attention refusing it): the
  update against ``dp1``'s, the check the mixin's context-parallel factor needs.

Writes a JSON summary to the path given and exits non-zero when an update is off by
more than 1e-4 relative to the update (float32 on GPU kernels).
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
from tests.trainer_worker.integrations.areal.actor_checks import relative as _relative
from tests.trainer_worker.integrations.areal.areal_runs import MODES, Case
from tests.trainer_worker.integrations.areal.megatron import megatron_runs

TOLERANCE = 1e-4


def _run(layout: str, cases: list[Case], folder: Path, model: Path) -> list[dict[str, Any]]:
    return megatron_runs.run(
        megatron_runs.Job(
            layout,
            cases,
            str(model),
            str(folder / layout),
            free_port(),
            reference=layout == "dp1",
            device="cuda",
        )
    )


def main(out: str) -> int:
    summary: dict[str, Any] = {
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "gpus": torch.cuda.device_count(),
    }
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = megatron_runs.save_model(folder / "model")
        cases = [Case(f"{mode}-one", mode=mode) for mode in MODES]
        cases.append(Case("stock-one", impl="stock"))
        one = _run("dp1", cases, folder, model)[0]
        summary["dp1_crash"] = one.get("crash")
        ok = ok and "crash" not in one
        for mode in MODES if ok else ():
            result = one[f"{mode}-one"]
            rel = _relative(result["params"], one["reference"][mode]["params"], result["initial"])
            summary[f"dp1_{mode}_vs_formula"] = rel
            summary[f"dp1_{mode}_normalizer"] = result["stats"].get("lossreduce/normalizer/pg")
            ok = ok and rel < TOLERANCE
        if ok:
            ours, stock = one["token_mean-one"], one["stock-one"]
            rel = _relative(ours["params"], stock["params"], stock["initial"])
            summary["dp1_token_mean_vs_stock"] = rel
            summary["grad_norm"] = [ours["stats"]["grad_norm"], stock["stats"]["grad_norm"]]
            summary["n_valid_tokens"] = stock["stats"]["n_valid_tokens"]
            summary["step_seconds"] = [ours["seconds"], stock["seconds"]]
            ok = ok and rel < TOLERANCE
        if ok and summary["gpus"] >= 2 and summary["transformer_engine"]:
            cp = _run(
                "cp2",
                [Case("token_mean-one"), Case("seq_mean-one", mode="seq_mean")],
                folder,
                model,
            )
            for rank, result in enumerate(cp):
                for name in ("token_mean-one", "seq_mean-one"):
                    got = result.get(name, {})
                    if "params" not in got:
                        summary[f"cp2_rank{rank}_{name}"] = str(got.get("init_error", result))
                        ok = False
                        continue
                    rel = _relative(got["params"], one[name]["params"], one[name]["initial"])
                    summary[f"cp2_rank{rank}_{name}_vs_dp1"] = rel
                    ok = ok and rel < TOLERANCE
        else:
            summary["cp2"] = "skipped: needs two GPUs and Transformer Engine"
    Path(out).write_text(json.dumps(summary, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
