"""``lossreduce bench --e2e``'s verl ``main_ppo`` step: its order, what it reads from
verl's file logger, and how a failed launch is reported.

The bench itself launches ``main_ppo`` four times (about 10 minutes on 2 cores); it is
run by hand and its figures are on docs/frameworks/verl.md. Here the launches are
replaced by their logged records, so the arithmetic and the errors are checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lossreduce.bench.frameworks import verl_main_ppo
from lossreduce.bench.frameworks.verl_main_ppo import (
    ROUND_KEY,
    STEP_KEY,
    UPDATE_KEY,
    MainPpoBenchError,
    MainPpoBenchSettings,
    abba_order,
    kept_timings,
    run_main_ppo_bench,
)
from lossreduce.trainer_worker.cpu_standins.verl.launch import Inputs, Launch


def _record(step: int, seconds: float, update: float) -> dict[str, Any]:
    # Stock launches log no round; the bench reads it from lossreduce launches only.
    return {"step": step, "data": {STEP_KEY: seconds, UPDATE_KEY: update, ROUND_KEY: update / 10}}


def test_launches_alternate_abba() -> None:
    assert abba_order(2) == [False, True, True, False, False, True, True, False]


def test_kept_timings_leave_out_the_first_steps_in_step_order() -> None:
    records = [_record(3, 0.3, 0.03), _record(1, 9.0, 0.9), _record(2, 0.2, 0.02)]
    assert kept_timings(records, 1, STEP_KEY) == [0.2, 0.3]
    assert kept_timings(records, 1, UPDATE_KEY) == [0.02, 0.03]


def test_a_missing_timer_names_the_key_and_the_steps() -> None:
    records = [_record(1, 1.0, 0.1), {"step": 2, "data": {}}]
    with pytest.raises(MainPpoBenchError, match=r"'timing_s/step' at steps \[2\]"):
        kept_timings(records, 0, STEP_KEY)


def test_steps_must_outnumber_the_warm_up() -> None:
    with pytest.raises(ValueError, match="steps 2 must exceed skip_steps 2"):
        MainPpoBenchSettings(steps=2, skip_steps=2)


def _fake_launches(
    monkeypatch: pytest.MonkeyPatch, runs: list[Launch], seen: list[list[str]]
) -> None:
    def write_inputs(folder: Path) -> Inputs:
        return Inputs(model=folder / "m", train=folder / "t", reward=folder / "r")

    def run_main_ppo(folder: Path, args: list[str], timeout: float) -> Launch:
        seen.append(args)
        return runs[len(seen) - 1]

    monkeypatch.setattr(verl_main_ppo, "write_inputs", write_inputs)
    monkeypatch.setattr(verl_main_ppo, "run_main_ppo", run_main_ppo)


def test_medians_per_side_and_their_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    def launch(step_s: float, update_s: float) -> Launch:
        # Step 1 is the warm-up: slow, and left out.
        records = [_record(1, 50.0, 5.0), *(_record(s, step_s, update_s) for s in (2, 3))]
        return Launch(0, "", records)

    # ABBA: stock, lossreduce, lossreduce, stock.
    runs = [launch(2.0, 0.4), launch(2.2, 0.5), launch(2.4, 0.5), launch(2.0, 0.4)]
    seen: list[list[str]] = []
    _fake_launches(monkeypatch, runs, seen)
    result = run_main_ppo_bench(MainPpoBenchSettings(steps=3, skip_steps=1))
    assert result.launches == 4
    assert (result.stock_steps, result.lossreduce_steps) == (4, 4)
    assert result.stock_step_s == pytest.approx(2.0)
    assert result.lossreduce_step_s == pytest.approx(2.3)
    assert result.ratio == pytest.approx(1.15)
    assert result.update_ratio == pytest.approx(1.25)
    assert result.lossreduce_round_s == pytest.approx(0.05)
    modes = ["trainer.v1.trainer_mode=lossreduce" in args for args in seen]
    assert modes == [False, True, True, False]
    assert all("trainer.total_training_steps=3" in args for args in seen)


def test_a_failed_launch_is_named_with_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [Launch(1, "Traceback ... ValueError: bad override", [_record(1, 1.0, 0.1)])]
    _fake_launches(monkeypatch, runs, [])
    with pytest.raises(MainPpoBenchError) as caught:
        run_main_ppo_bench(MainPpoBenchSettings(steps=3, skip_steps=1))
    message = str(caught.value)
    assert "launch 0 (stock) exited 1 after logging steps [1] of 3" in message
    assert "bad override" in message
