"""The verl step-cost measurement runs verl's real worker and ours on the same batch."""

from __future__ import annotations

import math

from lossreduce.trainer_worker.integrations.verl.bench import VerlBenchSettings, run_verl_bench


def test_the_bench_times_both_workers_in_abba_order() -> None:
    settings = VerlBenchSettings(
        steps=2, blocks=1, responses=8, micro_batch_size=4, hidden_size=16, layers=1
    )
    result = run_verl_bench(settings)
    # ABBA, one block: each worker runs twice, the first step of each run dropped.
    assert result.lossreduce_steps == result.verl_steps == 2
    assert result.lossreduce_step_s > 0
    assert result.verl_step_s > 0
    assert math.isfinite(result.ratio)
