"""``lossreduce bench --e2e`` without verl installed: the verl step is skipped, said in one line."""

from __future__ import annotations

import importlib.util

import pytest

from lossreduce.bench.e2e import run_verl_e2e, run_verl_statistics_e2e


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is not None,
    reason="verl is installed here: tests/trainer_worker/integrations/verl runs its bench",
)
def test_the_verl_step_is_skipped_without_verl(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_verl_e2e() is None
    assert "verl step: skipped (verl is not installed" in capsys.readouterr().out


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is not None,
    reason="verl is installed here: tests/trainer_worker/integrations/verl runs its bench",
)
def test_the_verl_statistics_step_is_skipped_without_verl(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_verl_statistics_e2e() is None
    assert "verl kl_cov step: skipped (verl is not installed" in capsys.readouterr().out
