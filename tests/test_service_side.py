"""The service side runs without the trainer side.

A plain ``pip install lossreduce`` has no torch, Ray, rich, matplotlib or
cryptography (and nothing brings numpy). Every service-side module must import, and
``lossreduce serve``/``status``/``agent`` must start, without them; ``lossreduce
train`` and ``bench`` must say what to install instead of an ImportError traceback.

The dev environment has all of them installed, so a child interpreter makes them
unimportable with a meta-path finder that refuses them, the way a missing package is
refused. The finder records who asked, so a lazy import inside a function that a
``--help`` run never reaches is still not this test's blind spot for module level.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from lossreduce.cli import TRAINER_MODULES

BLOCKED = (*TRAINER_MODULES, "numpy")

SERVICE_PACKAGES = ("lossreduce", "lossreduce.server", "lossreduce.client")
"""Walked with pkgutil (``lossreduce`` includes ``lossreduce.v2``)."""

NOT_SERVICE_SIDE = ("lossreduce.bench", "lossreduce.trainer_worker")
"""``lossreduce bench``'s package (a folder of its own; an installed tree holds it under
``lossreduce/``) and the trainer side."""

CHILD = textwrap.dedent(
    """
    import contextlib, importlib, importlib.abc, io, json, pkgutil, sys

    BLOCKED, PACKAGES, SKIPPED = json.loads(sys.argv[1])
    already = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    refused = []

    def importer():
        # The first frame outside the import machinery is the one that imports.
        frame = sys._getframe(2)
        while frame is not None and "importlib" in frame.f_code.co_filename:
            frame = frame.f_back
        return frame.f_globals.get("__name__", "?") if frame is not None else "?"

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.partition(".")[0] in BLOCKED:
                refused.append([fullname, importer()])
                raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
            return None

    sys.meta_path.insert(0, Refuse())

    def skipped(name):
        return any(name == s or name.startswith(s + ".") for s in SKIPPED)

    imported = []
    def walk(package):
        module = importlib.import_module(package)
        imported.append(package)
        for info in pkgutil.iter_modules(module.__path__, package + "."):
            if skipped(info.name):
                continue
            if info.ispkg:
                walk(info.name)
            else:
                importlib.import_module(info.name)
                imported.append(info.name)

    for package in PACKAGES:
        walk(package)

    from lossreduce.cli import main

    def run(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code
        return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

    service = {cmd: run([cmd, "--help"]) for cmd in ("serve", "status", "agent")}
    service_refused = list(refused)
    trainer = {cmd: run([cmd, "--help"]) for cmd in ("train", "bench")}
    print(json.dumps({
        "already": already,
        "imported": imported,
        "refused": service_refused,
        "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
        "service": service,
        "trainer": trainer,
    }))
    """
)


@pytest.fixture(scope="module")
def child() -> dict[str, object]:
    args = json.dumps([BLOCKED, SERVICE_PACKAGES, NOT_SERVICE_SIDE])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_nothing_blocked_was_loaded_before_the_child_started(child: dict[str, object]) -> None:
    assert child["already"] == []


def test_every_service_side_module_imports_without_the_trainer_side(
    child: dict[str, object],
) -> None:
    imported = child["imported"]
    assert isinstance(imported, list)
    # The walk really covered the tree: the binding, the coordinator, the client.
    assert {
        "lossreduce.cli",
        "lossreduce.v2",
        "lossreduce.v2.coordinator_pb2",
        "lossreduce.server.servicer",
        "lossreduce.server.cli",
        "lossreduce.client.sync",
        "lossreduce.client.agent_cli",
        "lossreduce.client.status_cli",
    } <= set(imported)
    assert not [m for m in imported if m.startswith(NOT_SERVICE_SIDE)]
    assert child["loaded"] == []


def test_no_lossreduce_module_so_much_as_tried_a_trainer_side_import(
    child: dict[str, object],
) -> None:
    """Third-party packages may probe for numpy and fall back; lossreduce's own
    service-side modules never ask for any of them."""
    refused = child["refused"]
    assert isinstance(refused, list)
    ours = [(name, by) for name, by in refused if by.partition(".")[0] == "lossreduce"]
    assert ours == []


@pytest.mark.parametrize("command", ["serve", "status", "agent"])
def test_service_commands_run_without_the_trainer_side(
    child: dict[str, object], command: str
) -> None:
    service = child["service"]
    assert isinstance(service, dict)
    run = service[command]
    assert run["code"] == 0, run["stderr"]
    assert run["stdout"].startswith(f"usage: lossreduce {command}")


@pytest.mark.parametrize("command", ["train", "bench"])
def test_trainer_commands_name_what_to_install(child: dict[str, object], command: str) -> None:
    trainer = child["trainer"]
    assert isinstance(trainer, dict)
    run = trainer[command]
    assert run["code"] == 1
    assert run["stdout"] == ""
    assert run["stderr"].startswith(f"lossreduce {command}: needs the trainer side")
    assert "torch" in run["stderr"]
    assert "pip install 'lossreduce[trainer]'" in run["stderr"]
    assert "Traceback" not in run["stderr"]
