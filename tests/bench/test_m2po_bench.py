"""A smoke test of ``lossreduce bench --m2po`` at tiny sizes (not timed): both backends
agree with the exact reference, and the figures come back."""

from __future__ import annotations

from lossreduce.bench.cli import build_parser
from lossreduce.bench.m2po import M2POBenchSettings, format_m2po_bench, run_m2po_bench


def test_m2po_bench_smoke() -> None:
    assert build_parser().parse_args(["--m2po"]).m2po
    report = run_m2po_bench(M2POBenchSettings(world_size=2, tokens_per_rank=3000, repeats=1))
    assert report["exact"] is True
    assert report["kept"] == [report["reference_kept"]]
    for method in ("torch", "coord"):
        row = report[method]
        assert 2 <= row["rounds"] <= 16
        assert 0 < row["sent_bytes"] < report["gather"]["sent_bytes"] == 8 * 3000
    table = format_m2po_bench(report)
    assert "search, coordinator" in table
    assert "the exact reference keeps" in table
