"""``--engine verl`` without verl: one line saying so and how to install it, before Ray starts.

Runs in the main environment, where verl is not installed (its pins conflict with
the trl extra's); ``sys.modules['verl'] = None`` keeps it absent in any environment.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import ray
from rich.console import Console

from lossreduce.trainer_worker.train.driver import run
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.worker_group import TrainingFailedError


def test_a_missing_verl_fails_before_ray_starts_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "verl", None)
    settings = TrainSettings(engine="verl", steps=1, progress=False, out=tmp_path)
    with pytest.raises(TrainingFailedError) as caught:
        run(settings, console=Console(file=io.StringIO()))
    message = str(caught.value)
    assert message.startswith("--engine verl: verl is not installed in this environment: ")
    assert "pip install 'lossreduce[verl]' into a verl==0.9.1 environment" in message
    assert "\n" not in message
    assert not ray.is_initialized()
    assert not any(tmp_path.iterdir())  # nothing was written either
