"""The verl step-cost measurement runs verl's real worker and ours on the same batch."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from lossreduce.bench.frameworks.verl import VerlBenchSettings, run_verl_bench


def test_the_bench_times_both_workers_in_abba_order() -> None:
    settings = VerlBenchSettings(
        rounds=2, responses=8, micro_batch_size=4, hidden_size=16, layers=1
    )
    result = run_verl_bench(settings)
    # Two ABBA rounds after one warm-up step each: every worker timed 4 times.
    assert result.lossreduce_steps == result.verl_steps == 4
    assert result.lossreduce_step_s > 0
    assert result.verl_step_s > 0
    assert math.isfinite(result.ratio)


def test_the_bench_times_kl_cov_with_its_statistic_over_the_mini_batch() -> None:
    """Both sides run verl's kl_cov; lossreduce's step adds the no-grad forward."""
    settings = VerlBenchSettings(
        rounds=1, responses=8, micro_batch_size=4, hidden_size=16, layers=1, loss_mode="kl_cov"
    )
    result = run_verl_bench(settings)
    assert result.lossreduce_steps == result.verl_steps == 2
    assert math.isfinite(result.ratio)


def test_the_bench_times_several_mini_batches_a_step_with_old_log_prob_reused() -> None:
    """Four mini-batches a timed step (each an optimizer step), the batch marked as the
    trainer mode marks one whose old_log_prob the actor recomputed."""
    settings = VerlBenchSettings(
        rounds=1,
        responses=8,
        micro_batch_size=2,
        mini_batches=4,
        old_log_probs_current=True,
        hidden_size=16,
        layers=1,
        loss_mode="kl_cov",
    )
    result = run_verl_bench(settings)
    assert result.lossreduce_steps == result.verl_steps == 2
    assert math.isfinite(result.ratio)


def test_the_mini_batches_must_split_the_responses_into_whole_micro_batches() -> None:
    with pytest.raises(ValidationError, match="mini_batches=3"):
        VerlBenchSettings(responses=8, micro_batch_size=2, mini_batches=3)
    with pytest.raises(ValidationError, match="micro_batch_size=4"):
        VerlBenchSettings(responses=8, micro_batch_size=4, mini_batches=4)
