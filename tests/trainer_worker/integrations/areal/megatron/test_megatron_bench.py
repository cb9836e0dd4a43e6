"""``lossreduce bench --e2e`` times AReaL's Megatron actor too, where AReaL's ``[megatron]``
packages are installed: the LossReduce ``MegatronPPOActor`` against AReaL's own, on the
CPU platform, beside FSDP and Archon.

The bench runs in a process of its own, as ``lossreduce bench`` does: importing AReaL
and Megatron-Core on Python 3.12 warns (uvloop's ``install``, Megatron's deprecations),
which this test process would turn into errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.trainer_worker.integrations.areal.trainer_loop import ROOT

BENCH = """
import json
from lossreduce.bench.e2e import run_areal_e2e
from lossreduce.bench.frameworks.areal import ArealBenchSettings
small = ArealBenchSettings(steps=3, blocks=1, groups=2, group_size=2, max_length=24)
print("RESULT " + json.dumps(run_areal_e2e(small)))
"""


def test_bench_e2e_times_megatron_beside_fsdp_and_archon() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BENCH],
        cwd=ROOT,
        env={**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert sorted(got) == ["archon", "fsdp", "megatron"]
    for step in got.values():
        # Two runs of each actor in the ABBA block, each dropping its warm-up step.
        assert step["lossreduce_steps"] == step["areal_steps"] == 4
        assert step["lossreduce_step_s"] > 0
        assert step["areal_step_s"] > 0
        assert step["met"] == (step["ratio"] <= 1.03)
    assert "AReaL megatron step: lossreduce" in done.stdout
