"""The AReaL step benchmark times the M2PO pair beside the plain one, in one run."""

from __future__ import annotations

import math

import pytest

from lossreduce.bench.frameworks.areal import ArealBenchSettings, run_areal_bench

# The bench keeps AReaL's torch.compile of its log-probabilities; tracing it makes
# dynamo touch a non-leaf tensor's .grad internally, which warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)


def test_the_bench_times_the_global_m2po_mask_beside_areals() -> None:
    settings = ArealBenchSettings(
        steps=3, blocks=1, groups=2, group_size=2, max_length=24, m2_threshold=0.01
    )
    result = run_areal_bench(settings)
    assert result.m2po is not None
    m2po = result.m2po
    assert math.isfinite(result.ratio)
    assert math.isfinite(m2po.ratio)
    # The cut-off ran in every measured step of the LossReduce actor, and cut.
    assert m2po.rounds >= 2
    assert 0 < m2po.kept < m2po.active
    assert 0 < m2po.cut_s < m2po.lossreduce_step_s
    assert m2po.cut_share == m2po.cut_s / m2po.lossreduce_step_s
