"""The AReaL step benchmark of ``lossreduce bench --e2e`` runs both actors on a small workload."""

from __future__ import annotations

import math

import pytest

from lossreduce.bench.e2e import run_areal_e2e
from lossreduce.bench.frameworks.areal import ArealBenchSettings, run_areal_bench

# The bench keeps AReaL's torch.compile of its log-probabilities; tracing it makes
# dynamo touch a non-leaf tensor's .grad internally, which warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)


SMALL = ArealBenchSettings(steps=3, blocks=1, groups=2, group_size=2, max_length=24)


@pytest.mark.parametrize("engine", ["fsdp", "archon"])
def test_the_bench_times_both_actors_abba(engine: str) -> None:
    settings = SMALL.model_copy(update={"engine": engine})
    result = run_areal_bench(settings)
    # Two runs of each actor per ABBA block, each dropping its first step.
    assert result.lossreduce_steps == result.areal_steps == 2 * (settings.steps - 1)
    assert result.lossreduce_step_s > 0
    assert result.areal_step_s > 0
    assert math.isfinite(result.ratio)


def test_bench_e2e_reports_each_installed_engines_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    got = run_areal_e2e(SMALL)
    assert got is not None
    # Megatron needs AReaL's [megatron] packages, which this environment leaves out.
    assert sorted(got) == ["archon", "fsdp"]
    assert "AReaL megatron step: skipped" in capsys.readouterr().out
    for step in got.values():
        assert step["ratio"] == step["lossreduce_step_s"] / step["areal_step_s"]
        assert step["met"] == (step["ratio"] <= 1.03)
        assert step["lossreduce_steps"] == step["areal_steps"] == 2 * (SMALL.steps - 1)
