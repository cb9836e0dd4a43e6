"""``lossreduce train`` refuses a bad flag, or a bad ``LOSSREDUCE_*`` variable its engine's
workers would read, in seconds and before Ray starts: one line naming the flag or variable,
the value and what is allowed (a :class:`ReductionConfigError`)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from rich.console import Console

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.train.cli import PROG, main, settings_from_argv
from lossreduce.trainer_worker.train.driver import run
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from tests.conftest import flag_error

LOSSREDUCE_CLI = Path(sys.executable).parent / "lossreduce"

OVERLAP_REFUSED = (
    "--engine trl reduction settings: LOSSREDUCE_OVERLAP=maybe: Input should be a valid "
    "boolean, unable to interpret input (allowed: true or false)"
)


@pytest.fixture(autouse=True)
def _no_lossreduce_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("LOSSREDUCE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--mode", "bogus"],
            "--mode bogus: must be one of token_mean, seq_mean, prompt_mean, constant",
        ),
        (
            ["--workers", "many"],
            "--workers many: Input should be a valid integer, unable to parse string as an "
            "integer (allowed: an integer >= 1 and <= 256)",
        ),
        (["--lr", "0"], "--lr 0: Input should be greater than 0 (allowed: a number > 0)"),
        (["--on-empty-step", "never"], "--on-empty-step never: must be one of raise, skip"),
    ],
)
def test_a_bad_flag_names_itself_its_value_and_what_is_allowed(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flag_error(main, argv, capsys, PROG) == expected
    with pytest.raises(ReductionConfigError) as caught:
        settings_from_argv(argv)
    assert str(caught.value) == expected


def test_several_bad_flags_are_named_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    message = flag_error(main, ["--mode", "bogus", "--steps", "0"], capsys, PROG)
    assert message.startswith("--steps 0: Input should be greater than or equal to 1"), message
    assert "; --mode bogus: must be one of" in message


def test_a_bad_variable_the_trl_workers_would_read_is_refused_before_ray(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LOSSREDUCE_OVERLAP", "maybe")
    started = time.monotonic()
    assert flag_error(main, ["--engine", "trl"], capsys, PROG) == OVERLAP_REFUSED
    with pytest.raises(ReductionConfigError) as caught:
        run(TrainSettings(engine="trl"), console=Console(file=io.StringIO()))
    assert str(caught.value) == OVERLAP_REFUSED
    assert time.monotonic() - started < 10
    assert not ray.is_initialized()


def test_good_variables_pass_and_an_engine_that_reads_none_ignores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOSSREDUCE_OVERLAP", "false")
    assert settings_from_argv(["--engine", "trl", "--normalizer", "torch"]).engine == "trl"
    assert settings_from_argv(["--engine", "trl", "--coordinator", "h:1"]).engine == "trl"
    # The torch engine's workers read no LOSSREDUCE_* setting but the token.
    monkeypatch.setenv("LOSSREDUCE_OVERLAP", "maybe")
    assert settings_from_argv([]).engine == "torch"


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--mode", "bogus"], {}, "--mode bogus: must be one of token_mean,"),
        (["--engine", "trl"], {"LOSSREDUCE_OVERLAP": "maybe"}, OVERLAP_REFUSED),
    ],
)
def test_the_command_exits_in_seconds_with_that_one_line(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [str(LOSSREDUCE_CLI), "train", *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"{PROG}: error: {expected}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    # Import time only (a loaded CI machine): no Ray, no worker.
    assert elapsed < 60, elapsed
