"""verl's ``python -m verl.trainer.main_ppo`` with the lossreduce trainer mode on CUDA.

Run by scripts/gpu_check.sh (``verl-main-ppo-cuda``) with verl's environment
(``PYTHON``, default ``.venv-verl/bin/python``) on a machine with a GPU; it has not
been run in this project (no GPU was lent). It is the launch of
``test_main_ppo.py`` (docs/frameworks/verl.md;
:mod:`lossreduce.trainer_worker.cpu_standins.verl.launch`) on one CUDA rank with verl's
own CUDA platform (nccl), generation still from lossreduce's CPU rollout, 3 GRPO steps,
``prompt_mean`` through the job's coordinator actor. It writes a JSON summary to the
path given (each step's round span, normalizers and gradient norm) and exits
non-zero unless every mini-batch had its round.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from lossreduce.trainer_worker.cpu_standins.verl import launch

MINI_BATCHES = 2  # data.train_batch_size / actor.ppo_mini_batch_size


def main(out: Path) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        inputs = launch.write_inputs(folder)
        args = [*launch.overrides(inputs, cuda=True), *launch.LOSSREDUCE]
        run = launch.run_main_ppo(folder, args, timeout=220, cuda=True)
        steps = [
            {
                k: v
                for k, v in s["data"].items()
                if k.startswith(("actor/lossreduce/", "actor/grad"))
            }
            for s in run.steps
        ]
        expected = [(i * MINI_BATCHES, (i + 1) * MINI_BATCHES - 1) for i in range(launch.STEPS)]
        spans = [
            (s.get("actor/lossreduce/round_min"), s.get("actor/lossreduce/round_max"))
            for s in steps
        ]
        ok = run.returncode == 0 and spans == expected
        out.write_text(
            json.dumps({"returncode": run.returncode, "steps": steps, "ok": ok}, indent=1)
        )
        if not ok:
            print(run.output[-6000:])
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
