"""``--engine areal`` without AReaL (the main environment): its flags are judged, and the run
fails before Ray starts with one line saying how to install AReaL. The engine's runs are
in ``areal/`` (``.venv-areal``, ``make test-areal``)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import ray
from rich.console import Console

from lossreduce.trainer_worker.train.cli import PROG, main
from lossreduce.trainer_worker.train.driver import run
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import TrainingFailedError
from tests.conftest import flag_error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--engine", "areal", "--model", "/x"],
            "--model /x: --engine areal trains the built-in tiny Qwen2 over the task's token ids",
        ),
        (
            ["--engine", "areal", "--workers", "4", "--prompts-per-step", "3"],
            "--engine areal: --prompts-per-step 3 is fewer than --workers 4; every rank samples",
        ),
    ],
)
def test_flags_the_areal_engine_cannot_honour_are_refused_in_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in flag_error(main, argv, capsys, PROG)


@pytest.mark.skipif(
    importlib.util.find_spec("areal") is not None,
    reason="AReaL is installed here: tests/trainer_worker/train/engines/areal runs the engine",
)
def test_a_missing_areal_fails_before_ray_starts_saying_how_to_install_it(
    tmp_path: Path,
) -> None:
    settings = TrainSettings(engine="areal", steps=1, progress=False, out=tmp_path)
    with pytest.raises(TrainingFailedError) as caught:
        run(settings, console=Console(file=io.StringIO()))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--engine areal: ")
    assert "needs AReaL: pip install areal==1.0.4 and then 'lossreduce[areal]'" in message
    assert not ray.is_initialized()
    assert not (tmp_path / "model").exists()  # nothing was built either
