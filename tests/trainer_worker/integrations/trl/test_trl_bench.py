"""The TRL step benchmark runs end to end on a tiny workload (its numbers are not judged here)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl", reason="needs the trl extra: pip install 'lossreduce[trl]'")

from lossreduce.bench.frameworks.trl import TRLBenchSettings, run_trl_bench


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_bench_times_both_trainers_in_abba_order() -> None:
    settings = TRLBenchSettings(
        steps=2,
        blocks=1,
        prompts=2,
        num_generations=2,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        hidden_size=16,
        layers=1,
    )
    result = run_trl_bench(settings)
    # Two runs per trainer, each timing every step but its first.
    assert result.lossreduce_steps == result.dapo_steps == 2
    assert math.isfinite(result.ratio)
    assert result.ratio > 0
