"""The AReaL install a user reads works: a fresh environment built with exactly the
commands of docs/frameworks/areal.md imports the integration and runs
``lossreduce train --engine areal``; the README gives the same commands.

The fresh environment reuses pip's cache and index; only this checkout stands in
for ``lossreduce[areal]``, and the constraints file pins the dependencies
(``documented_install.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_worker.integrations.areal import documented_install

ROOT = documented_install.ROOT
CONSTRAINTS = Path(__file__).resolve().parent / "constraints.txt"


def test_the_readme_gives_the_documented_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = documented_install.documented_commands()
    assert commands == [
        "pip install 'lossreduce[areal]'",
        "pip install --no-deps areal==1.0.4 swanlab==0.6.12",
    ]
    for command in commands:
        assert f"`{command}`" in readme, command


def _run(args: list[str], timeout_s: float) -> str:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT
    )
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(1200)
def test_a_fresh_environment_from_the_documented_commands_trains(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], 120)
    python = str(venv / "bin" / "python")
    _run(
        [
            python,
            str(documented_install.__file__),
            "--python",
            python,
            "--constraints",
            str(CONSTRAINTS),
        ],
        900,
    )
    # The installed package, not this checkout: run outside the repository.
    found = subprocess.run(
        [
            python,
            "-c",
            "import lossreduce, lossreduce.trainer_worker.integrations.areal as a; "
            "print(lossreduce.__file__, a.LossReducePPOTrainer.__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    assert str(venv) in found.stdout, found.stdout
    assert "LossReducePPOTrainer" in found.stdout, found.stdout
    out = tmp_path / "run"
    train = subprocess.run(
        [
            str(venv / "bin" / "lossreduce"),
            "train",
            "--engine",
            "areal",
            "--num-cpus",
            "2",
            "--workers",
            "2",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--samples-per-prompt",
            "4",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--layers",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert train.returncode == 0, f"{train.stdout[-3000:]}\n{train.stderr[-3000:]}"
    assert "--engine areal" in train.stdout
    assert (out / "metrics.jsonl").read_text().count("\n") >= 1
