"""``pip install lossreduce`` in a fresh virtual environment is a working service side.

Built and installed as a user gets it: a real (not editable) install of the source
tree with no extra, into a new venv. Its dependencies come from the package index
(this test downloads them, or takes them from pip's cache). It then serves, reduces,
reports status, and refuses ``lossreduce train`` with what to install, all from that
venv and none of this environment's packages.

About 20-30 s (pip's cache warm; 17 s for the install alone with no cache): creating
the venv and resolving and installing the 15 service-side wheels are most of it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
import time

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[str]:
    """What a build needs, as deploy/Dockerfile copies it: pyproject.toml, the readme
    and every folder of ``package-dir``."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {p.split("/")[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()}
    return ["pyproject.toml", pyproject["project"]["readme"], *sorted(folders)]


TRAINER_SIDE = ("torch", "ray", "rich", "matplotlib", "cryptography", "numpy")

INSTALL_TIMEOUT_S = 420
COMMAND_TIMEOUT_S = 60

REDUCE = textwrap.dedent(
    """
    import json, sys, threading
    from lossreduce.client import ReductionClient

    target = sys.argv[1]
    results = {}

    def rank(r, tokens):
        with ReductionClient(target, job="fresh", group="actor", rank=r, world_size=2) as c:
            results[r] = c.reduce(0, {"pg": tokens}, contracts={"pg": "mean:token_mean"})

    threads = [threading.Thread(target=rank, args=(r, t)) for r, t in ((0, 3), (1, 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    print(json.dumps(results))
    """
)


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", COMMAND_TIMEOUT_S)
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload, no-any-return]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv holding ``pip install <source tree>``, no extras; removed afterwards."""
    base = tmp_path_factory.mktemp("fresh-install")
    # A copy of the sources: pip builds in the tree it is given (build/, *.egg-info),
    # and the checkout is shared with whatever else runs in it.
    source = base / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.png")
    for name in _sources():
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    venv = base / "venv"
    started = time.monotonic()
    created = _run([sys.executable, "-m", "venv", str(venv)])
    assert created.returncode == 0, created.stderr
    # PYTHONPATH and a virtualenv of the parent must not leak into the child's pip.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(source)],
        timeout=INSTALL_TIMEOUT_S,
        env=env,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # Shown with -rA or on failure; the report keeps an eye on what the install costs.
    print(f"venv + pip install: {time.monotonic() - started:.1f} s")
    yield venv
    shutil.rmtree(base, ignore_errors=True)


def _bin(venv: Path, name: str) -> str:
    return str(venv / "bin" / name)


def test_the_install_is_not_editable_and_has_no_trainer_side(venv: Path) -> None:
    done = _run(
        [
            _bin(venv, "python"),
            "-c",
            "import importlib.metadata as m, json, lossreduce; print(json.dumps(["
            "sorted(d.metadata['Name'].lower() for d in m.distributions()), lossreduce.__file__]))",
        ],
        cwd=venv,  # not the checkout, whose proto/ must not be what imports
    )
    assert done.returncode == 0, done.stderr
    names, location = json.loads(done.stdout)
    assert "lossreduce" in names
    assert Path(location).is_relative_to(venv), location
    assert [n for n in TRAINER_SIDE if n in names] == []
    assert not [n for n in names if n.startswith("nvidia-")]


def test_the_trainer_side_import_says_what_to_install(venv: Path) -> None:
    done = _run([_bin(venv, "python"), "-c", "import lossreduce.trainer_worker"], cwd=venv)
    assert done.returncode == 1
    assert "pip install 'lossreduce[trainer]'" in done.stderr.splitlines()[-1]


def test_serve_reduce_and_status_from_the_fresh_venv(venv: Path, tmp_path: Path) -> None:
    server = subprocess.Popen(
        [
            _bin(venv, "lossreduce"),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--journal",
            str(tmp_path / "journal.sqlite3"),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert server.stdout is not None
    pipe = server.stdout

    def read() -> None:
        for line in pipe:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # "lossreduce coordinator serving on 127.0.0.1:PORT (metrics: ...)"
        announced = lines.get(timeout=COMMAND_TIMEOUT_S)
        assert "serving on 127.0.0.1:" in announced, announced
        target = announced.split("serving on ", 1)[1].split()[0]

        reduced = _run([_bin(venv, "python"), "-c", REDUCE, target], cwd=tmp_path)
        assert reduced.returncode == 0, reduced.stderr
        assert json.loads(reduced.stdout) == {"0": {"pg": 8.0}, "1": {"pg": 8.0}}

        status = _run(
            [_bin(venv, "lossreduce"), "status", "--coordinator", target, "--job", "fresh"]
        )
        assert status.returncode == 0, status.stderr
        assert "fresh" in status.stdout
        assert "actor" in status.stdout
    finally:
        server.terminate()
        try:
            server.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(timeout=COMMAND_TIMEOUT_S)  # EOF once the server is gone
        pipe.close()
    output = "".join(lines.queue)
    assert server.returncode == 0, output


@pytest.mark.parametrize("command", ["train", "bench"])
def test_trainer_commands_from_the_fresh_venv_name_what_to_install(
    venv: Path, command: str
) -> None:
    done = _run([_bin(venv, "lossreduce"), command, "--help"], cwd=venv)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"lossreduce {command}: needs the trainer side, and torch")
    assert done.stderr.rstrip().endswith("pip install 'lossreduce[trainer]'")
