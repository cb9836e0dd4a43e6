"""The install docs/frameworks/verl.md gives a user, into a fresh environment, then
``lossreduce train --engine verl`` and ``--verify`` in it.

The environment is built with exactly the page's commands (read from the page by
:mod:`.documented_install`; lossreduce from this checkout, not editable, as a user
gets it), with nothing from the test environment: a package verl imports but the
``verl`` extra leaves out fails here. pip's cache makes the build take minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_worker.integrations.verl import documented_install

TINY = [
    "--workers", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
    "--d-model", "16", "--heads", "2", "--layers", "1", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("documented-verl") / "venv"
    # The interpreter running the tests: Python 3.11, as the page asks; not its packages.
    subprocess.run([sys.base_prefix + "/bin/python3.11", "-m", "venv", str(root)], check=True)
    documented_install.install(root / "bin" / "python")
    return root


def _lossreduce(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # A clean environment: nothing of the test process (its venv, PYTHONPATH, verl's
    # test settings) may make the documented one work.
    env = {key: os.environ[key] for key in ("HOME", "TMPDIR", "LANG") if key in os.environ}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    return subprocess.run(
        [str(venv / "bin" / "lossreduce"), "train", "--engine", "verl", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=480, check=False,
    )  # fmt: skip


def test_the_documented_install_is_every_line_of_the_block() -> None:
    commands = documented_install.documented_commands()
    assert commands == [
        ["pip", "install", "--upgrade", "pip"],
        ["pip", "install", "torch==2.13.0", "lossreduce[verl]"],
    ]


# The fresh environment's install takes minutes, more when the machine is busy.
@pytest.mark.timeout(1800)
def test_lossreduce_train_and_verify_run_in_the_documented_environment(
    venv: Path, tmp_path: Path
) -> None:
    done = _lossreduce(venv, ["--steps", "3", "--out", str(tmp_path / "run"), *TINY], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [step["step"] for step in steps] == [0, 1, 2]
    verified = _lossreduce(venv, ["--verify", "--out", str(tmp_path / "verify"), *TINY], tmp_path)
    assert verified.returncode == 0, verified.stderr[-4000:]
    assert "--verify PASSED" in verified.stdout, verified.stdout[-2000:]
