"""The AReaL install a user reads works: the environment built with exactly the
commands of docs/frameworks/areal.md (AReaL with its own dependencies, then
lossreduce) has no broken requirement, holds the tested versions, imports the
integration and runs ``lossreduce train --engine areal``; the README gives the
same commands.

That environment is the lane's own: ``make test-areal`` builds it with the page's
commands (``documented_install.py``: this checkout stands in for
``lossreduce[areal]``, and constraints/areal.txt pins every package), so the suite
checks it rather than installing a second one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_worker.integrations.areal import documented_install

ROOT = documented_install.ROOT
CONSTRAINTS = ROOT / "constraints" / "areal.txt"


def _pinned() -> dict[str, str]:
    """constraints/areal.txt as {normalized name: version}."""
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_the_constraints_keep_areals_own_choices() -> None:
    pins = _pinned()
    assert pins["areal"] == "1.0.4"
    assert pins["torch"] == "2.10.0"
    assert pins["protobuf"].startswith("6.")
    assert pins["transformers"] == "5.3.0"
    assert pins["swanlab"] == "0.6.12"


def test_the_readme_gives_the_documented_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = documented_install.documented_commands()
    assert commands == [
        "pip install areal==1.0.4",
        "pip install 'lossreduce[areal]'",
    ]
    for command in commands:
        assert f"`{command}`" in readme, command


def _run(args: list[str], timeout_s: float) -> str:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT
    )
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _installed(python: str) -> dict[str, str]:
    listed = json.loads(_run([python, "-m", "pip", "list", "--format", "json"], 300))
    return {re.sub(r"[-_.]+", "-", p["name"]).lower(): p["version"] for p in listed}


@pytest.mark.timeout(900)
def test_the_lane_environment_is_the_documented_install_and_trains(tmp_path: Path) -> None:
    # The environment running this test is the documented install: `make test-areal`
    # builds it with exactly the page's commands (documented_install.py, this checkout
    # editable for lossreduce[areal], every dependency pinned by constraints/areal.txt),
    # then the test tools, whose versions the constraints pin too. Checking it here
    # instead of building a second one saves that install; the non-editable build of
    # the package is tests/test_fresh_install.py's.
    venv = Path(sys.prefix)
    python = str(venv / "bin" / "python")
    # No broken requirement (an install without AReaL's dependencies left some).
    assert "No broken requirements found." in _run([python, "-m", "pip", "check"], 300)
    # Every package is the pinned one: torch 2.10.0 from the index, not a local build.
    installed = _installed(python)
    pins = _pinned()
    assert installed["torch"] == "2.10.0", installed["torch"]
    assert installed["areal"] == "1.0.4", installed["areal"]
    unpinned = {
        n: v for n, v in installed.items() if n not in pins and n not in {"lossreduce", "pip"}
    }
    assert unpinned == {}, unpinned
    moved = {n: (v, pins[n]) for n, v in installed.items() if n in pins and v != pins[n]}
    assert moved == {}, moved
    # Nothing of the test process helps: outside the repository, without PYTHONPATH,
    # only the environment's own commands on PATH.
    clean = {key: os.environ[key] for key in ("HOME", "TMPDIR", "LANG") if key in os.environ}
    clean["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
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
        env=clean,
    )
    assert found.returncode == 0, found.stderr[-3000:]
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
        env=clean,
    )
    assert train.returncode == 0, f"{train.stdout[-3000:]}\n{train.stderr[-3000:]}"
    assert "--engine areal" in train.stdout
    assert (out / "metrics.jsonl").read_text().count("\n") >= 1
