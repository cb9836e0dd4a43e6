"""The install docs/frameworks/verl.md gives a verl user, into a fresh verl environment,
then ``lossreduce train --engine verl`` and ``--verify`` in it.

The environment starts as a ``verl[vllm]==0.9.1`` user's without vllm, at the versions
pip's resolver picks for it (``constraints/verl.txt``), and then gets exactly the
page's commands (read from the page by :mod:`.documented_install`; lossreduce from
this checkout, not editable, as a user gets it) under the same pins, with nothing
from the test environment: a package the run imports that neither verl's environment
nor the ``verl`` extra brings fails here, and so does a documented command that would
move one of verl's versions. pip's cache makes the build take minutes.
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
    python = root / "bin" / "python"
    documented_install.install(python, constraints=documented_install.CONSTRAINTS)
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
    assert commands == [["pip", "install", "lossreduce[verl]"]]


def test_the_verl_environment_is_verl_vllm_less_vllm_at_its_resolved_versions() -> None:
    pins = dict(
        line.split("==", 1)
        for line in documented_install.CONSTRAINTS.read_text().splitlines()
        if line and not line.startswith("#")
    )
    # What pip's resolver picks for verl[vllm]==0.9.1 on Python 3.11 (the page says so).
    assert {name: pins[name] for name in ("verl", "torch", "protobuf", "transformers", "ray")} == {
        "verl": "0.9.1",
        "torch": "2.11.0",
        "protobuf": "7.36.2",
        "transformers": "5.9.0",
        "ray": "2.60.0",
    }
    assert "vllm" not in pins


def test_the_test_environment_holds_the_resolved_versions() -> None:
    # The running interpreter is .venv-verl's (make test-verl): verl's versions, not ours.
    import google.protobuf
    import ray
    import torch
    import transformers

    # torch 2.11.0 from the index, the CUDA build verl[vllm] brings (it runs on CPU),
    # not the CPU build of another release that the machine may hold.
    assert torch.__version__.split("+")[0] == "2.11.0"
    assert torch.version.cuda is not None
    assert (google.protobuf.__version__, transformers.__version__, ray.__version__) == (
        "7.36.2",
        "5.9.0",
        "2.60.0",
    )


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
