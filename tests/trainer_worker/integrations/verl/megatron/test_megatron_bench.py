"""``lossreduce bench --e2e`` times verl's Megatron actor step too, where verl's ``mcore``
packages are installed: LossReduceTrainingWorker against verl's own ``TrainingWorker``
(``token-mean``), both on verl's Megatron engine on the CPU stand-ins, in a process of
its own (:mod:`..bench_process`)."""

from __future__ import annotations

from tests.trainer_worker.integrations.bench_process import bench_result

BENCH = """
import json
from lossreduce.bench.e2e import run_verl_megatron_e2e
from lossreduce.bench.frameworks.verl import VerlBenchSettings
small = VerlBenchSettings(rounds=2, responses=8, micro_batch_size=4, hidden_size=32)
print("RESULT " + json.dumps(run_verl_megatron_e2e(small)))
"""


def test_bench_e2e_times_verls_megatron_step() -> None:
    step, output = bench_result(BENCH, {"PYTHONWARNINGS": "ignore"})
    # Two ABBA rounds: each worker's step twice a round, after its warm-up step.
    assert step["lossreduce_steps"] == step["verl_steps"] == 4
    assert step["lossreduce_step_s"] > 0
    assert step["verl_step_s"] > 0
    assert step["met"] == (step["ratio"] <= 1.03)
    assert "verl Megatron step: lossreduce" in output
