"""A run's outputs: matplotlib loads only when the plot is drawn, and the plot is a PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lossreduce.trainer_worker.train.outputs import RunOutputs, StepRecord


def test_importing_the_outputs_does_not_import_matplotlib() -> None:
    # A child interpreter: another test may have imported matplotlib here already.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, lossreduce.trainer_worker.train.outputs; "
            "print('matplotlib' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_plot_is_drawn_headless(tmp_path: Path) -> None:
    record = StepRecord(
        step=0,
        reward=0.5,
        losses={"pg": 0.25},
        normalizers={"pg": 12.0},
        round_latency_s=0.01,
        step_seconds=0.5,
        skipped=False,
        responses=8,
        groups=2,
        tokens=40,
    )
    with RunOutputs(tmp_path, total_steps=1, progress=False) as outputs:
        outputs.on_step(record)
        outputs.write_plot()
    assert outputs.plot_path.read_bytes().startswith(b"\x89PNG")
