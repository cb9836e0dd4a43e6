"""verl's FSDP2 engine on CUDA with and without lossreduce: one mini-batch, one rank.

Part of scripts/gpu_check.sh. Builds the tiny Qwen2 of the CPU tests, runs one
``train_mini_batch`` of verl's stock ``TrainingWorker`` (token-mean) and of
``LossReduceTrainingWorker`` (token_mean) on the same batch with plain SGD, and
writes to the JSON file named on the command line: the relative difference of
the two updates, the normalizers used, and the device-to-host synchronizations
of one mini-batch step of each (counted with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(
    MASTER_ADDR="127.0.0.1",
    RANK="0",
    LOCAL_RANK="0",
    WORLD_SIZE="1",
    LOCAL_WORLD_SIZE="1",
    HF_HUB_OFFLINE="1",
)


def main(out: Path) -> int:
    import torch

    from lossreduce.ports import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from lossreduce.trainer_worker.cpu_standins.verl import launch as cpu_launch
    from tests.trainer_worker.integrations.verl import tiny_verl, verl_runs

    def one(case: verl_runs.Case, model_dir: Path) -> dict[str, object]:
        worker = verl_runs._worker(case, model_dir)
        data = tiny_verl.tensordict(tiny_verl.rows(), mini_batch_size=tiny_verl.BATCH)
        warm = tiny_verl.tensordict(tiny_verl.rows(), mini_batch_size=tiny_verl.BATCH)
        before = verl_runs._params(worker)
        worker.train_mini_batch(warm)  # warm-up step (allocations, kernels)
        middle = verl_runs._params(worker)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            worker.train_mini_batch(data)
        torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchronizing" in str(w.message) for w in seen)
        return {
            "update": {n: (middle[n] - before[n]).cpu() for n in before},
            "syncs": syncs,
            "normalizers": getattr(worker, "last_normalizers", None),
        }

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = cpu_launch.save_model(Path(scratch))
        stock = one(verl_runs.Case("verl", worker="verl"), model_dir)
        ours = one(verl_runs.Case("lossreduce"), model_dir)
    a, b = ours["update"], stock["update"]
    assert isinstance(a, dict)
    assert isinstance(b, dict)
    num = sum(float(((a[n] - b[n]).double() ** 2).sum()) for n in b)
    den = sum(float((b[n].double() ** 2).sum()) for n in b)
    report = {
        "device": torch.cuda.get_device_name(0),
        "relative_update_difference": (num / den) ** 0.5,
        "normalizers": ours["normalizers"],
        "d2h_syncs_per_step": {"verl": stock["syncs"], "lossreduce": ours["syncs"]},
    }
    out.write_text(json.dumps(report, indent=2))
    return 0 if report["relative_update_difference"] <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
