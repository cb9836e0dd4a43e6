"""The install docs/frameworks/verl.md gives a verl user, and ``lossreduce train --engine
verl`` and ``--verify`` run in what it installs.

The lane's own environment is that install: ``make test-verl`` builds ``.venv-verl``
(envs.mk) as a ``verl[vllm]==0.9.1`` user's environment without vllm, at the versions
pip's resolver picks for it (``constraints/verl.txt``), then runs exactly the page's
commands (read from the page by :mod:`.documented_install`) under the same pins, adds
the test tools (pytest, pytest-timeout, hypothesis) and fails unless its ``pip freeze``
(``<venv>/freeze.txt``) equals the constraints: a documented command that would move
one of verl's versions fails to build it. Here, in that environment (the running
interpreter's ``sys.prefix``):

- nothing was installed since the build, and the build holds the page's install plus
  only what the test tools brought (:func:`tools_only_distributions`);
- ``lossreduce train`` and ``--verify`` run from a clean environment (the venv's
  ``bin`` and the system's on ``PATH``, nothing else of the test process), outside the
  repository, with the modules only the test tools brought not found in any process of
  the run: a package the run imports that neither verl's environment nor the ``verl``
  extra brings fails here, as it would for a user.

lossreduce is installed editable here; the wheel a user gets (every source package
listed, a non-editable install that works) is checked by tests/test_packaging.py and
tests/test_fresh_install.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.trainer_worker.integrations.verl import documented_install

ROOT = Path(__file__).resolve().parents[4]
TINY = [
    "--workers", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
    "--d-model", "16", "--heads", "2", "--layers", "1", "--no-progress",
]  # fmt: skip
TEST_TOOLS = ("pytest", "pytest-timeout", "hypothesis")
"""What envs.mk installs after the page's commands."""
UNFROZEN = ("lossreduce", "pip")
"""What the build's ``pip freeze`` leaves out (this checkout, editable; pip itself)."""
BLOCKER = '''\
import sys
from importlib.machinery import PathFinder

BLOCKED = frozenset({blocked!r})


class WithoutTestTools(PathFinder):
    """sys.path's finder, blind to the modules only the test tools brought: they are not
    found (importlib.util.find_spec gives None, an import fails), as for a verl user."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[sys.meta_path.index(PathFinder)] = WithoutTestTools
'''
"""``sitecustomize`` of the run: every Python process of it (the driver, Ray's workers,
which inherit its environment) imports it at start-up."""
PROBE = "import importlib.util as u; assert u.find_spec('hypothesis') is None; import hypothesis"


def _installed() -> dict[str, metadata.Distribution]:
    """The distributions in the venv's site-packages (not the checkout's egg-info, which
    the test process's ``sys.path`` may show too)."""
    site = sysconfig.get_paths()["purelib"]
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[site])}


def _closure(roots: Iterable[str], installed: dict[str, metadata.Distribution]) -> set[str]:
    """The installed distributions ``roots`` (requirement strings) need, with their extras'."""
    needed: set[str] = set()
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(root) for root in roots]
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in done or name not in installed:
            continue
        done.add((name, extras))
        needed.add(name)
        for text in installed[name].requires or []:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append(dep)
    return needed


def tools_only_distributions() -> set[str]:
    """The installed distributions a verl user's install does not need: not needed by
    :data:`documented_install.VERL_ENVIRONMENT`, the page's commands, or the venv's own pip
    and setuptools."""
    installed = _installed()
    documented = [
        arg for command in documented_install.documented_commands() for arg in command[2:]
    ]
    user = _closure(
        [*documented_install.VERL_ENVIRONMENT, *documented, "pip", "setuptools"], installed
    )
    return set(installed) - user


def _top_level_modules(names: Iterable[str]) -> set[str]:
    """The importable top-level names the distributions ``names`` installed."""
    installed = _installed()
    modules: set[str] = set()
    for name in names:
        for file in installed[name].files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith((".dist-info", ".data")):
                continue
            module = top.removesuffix(".py") if len(file.parts) == 1 else top
            if len(file.parts) == 1 and ".so" in top:
                module = top.split(".")[0]
            if module.isidentifier():
                modules.add(module)
    return modules


def _frozen(lines: Iterable[str]) -> dict[str, str]:
    pins = (line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {canonicalize_name(name): version for name, version in pins}


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


def test_the_test_environment_is_the_documented_install_and_the_test_tools() -> None:
    freeze = Path(sys.prefix) / "freeze.txt"
    assert freeze.exists(), f"{sys.prefix} is not a lane environment built by envs.mk"
    frozen = _frozen(freeze.read_text().splitlines())
    # The build's check: its freeze is the constraints, exactly.
    assert frozen == _frozen(documented_install.CONSTRAINTS.read_text().splitlines())
    # Nothing was installed, removed or moved since (a package added by hand would make
    # the run below pass where a user's would fail).
    installed = {name: d.version for name, d in _installed().items() if name not in UNFROZEN}
    assert installed == frozen
    # Beyond the page's install, the test tools and what only they need: the run below
    # does not find exactly these (pytest itself comes with verl's verl-core extra).
    extra = tools_only_distributions()
    assert extra <= _closure(TEST_TOOLS, _installed()), extra
    assert {"hypothesis", "pytest-timeout"} <= extra


@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A clean environment for the lane's venv: nothing of the test process (its PATH,
    PYTHONPATH, verl's test settings) may make the documented install work, and the
    modules only the test tools brought are not found (:data:`BLOCKER`)."""
    blocked = sorted(_top_level_modules(tools_only_distributions()))
    site = tmp_path_factory.mktemp("user-site")
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    env = {key: os.environ[key] for key in ("HOME", "TMPDIR", "LANG") if key in os.environ}
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}:/usr/bin:/bin"
    env["PYTHONPATH"] = str(site)
    # The test tools' modules are not found (else the run below would prove nothing).
    probe = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "python"), "-c", PROBE],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "No module named 'hypothesis'" in probe.stderr, probe.stderr
    return env


def _lossreduce(
    env: dict[str, str], args: list[str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    assert ROOT not in [cwd, *cwd.parents]  # lossreduce imported as installed, not from here
    return subprocess.run(
        [str(Path(sys.prefix) / "bin" / "lossreduce"), "train", "--engine", "verl", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=480, check=False,
    )  # fmt: skip


# Two runs of up to 480 s each (both together take about a minute on 2 cores).
@pytest.mark.timeout(1200)
def test_lossreduce_train_and_verify_run_in_the_documented_environment(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    done = _lossreduce(user_env, ["--steps", "3", "--out", str(tmp_path / "run"), *TINY], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    steps = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [step["step"] for step in steps] == [0, 1, 2]
    verified = _lossreduce(
        user_env, ["--verify", "--out", str(tmp_path / "verify"), *TINY], tmp_path
    )
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-4000:]
    assert "--verify PASSED" in verified.stdout, verified.stdout[-2000:]
