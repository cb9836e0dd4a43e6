"""The SkyRL update benchmark of ``lossreduce bench --e2e`` runs both workers on a small workload.

It runs in a process of its own (SkyRL's CPU platform changes torch for the whole process)."""

from __future__ import annotations

import json
import subprocess
import sys

SMALL = "SkyRLBenchSettings(rounds=2, responses=8, micro_batch_size=4, hidden_size=16, layers=1)"
SCRIPT = f"""
import json
from lossreduce.bench.e2e import run_skyrl_e2e
from lossreduce.bench.frameworks.skyrl import SkyRLBenchSettings
print("RESULT " + json.dumps(run_skyrl_e2e({SMALL})))
"""


def test_bench_e2e_times_both_workers_abba() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    # Two updates of each worker per ABBA round, after one warm-up each.
    assert got["lossreduce_steps"] == got["skyrl_steps"] == 4
    assert got["lossreduce_step_s"] > 0
    assert got["skyrl_step_s"] > 0
    assert got["ratio"] == got["lossreduce_step_s"] / got["skyrl_step_s"]
    assert got["met"] == (got["ratio"] <= 1.03)
    assert "SkyRL step: lossreduce" in done.stdout
