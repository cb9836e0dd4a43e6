"""Every dotted ``lossreduce.*`` name the README and the docs pages mention exists.

`mkdocs build --strict` fails on a renamed symbol behind an API reference
directive; this covers the names in the prose (``lossreduce.status_codec.from_status``,
``lossreduce.client.settings.BASE_CHANNEL_OPTIONS``, ...), so a move or rename
in the code takes its mention along.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "lossreduce" / "v2" / "coordinator.proto"
# Not part of a path or a longer word (``grpo_lossreduce.py``, ``grafana/lossreduce.json``).
_NAME = re.compile(r"(?<![\w/.-])lossreduce(?:\.[A-Za-z_]\w*)+")


def mentioned_names() -> set[str]:
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    return {name for page in pages for name in _NAME.findall(page.read_text())}


FRAMEWORK_PACKAGES = {
    "lossreduce.trainer_worker.integrations.verl": ROOT / "trainer_worker/integrations/verl",
    "lossreduce.trainer_worker.integrations.areal": ROOT / "trainer_worker/integrations/areal",
    "lossreduce.trainer_worker.cpu_standins": ROOT / "trainer_worker/cpu_standins",
    "lossreduce.bench.frameworks": ROOT / "bench/frameworks",
}
"""Packages that need a framework with an environment of its own (not this one): the
verl and AReaL integrations, the CPU stand-ins and the framework benches. Their names
are looked up in the source instead of imported."""


def _defined_at_top(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def exists_in_source(name: str, package: str, folder: Path) -> bool:
    """Whether ``name`` (under ``package``, whose source is ``folder``) is a module of
    it or a name defined at the top of one."""
    rest = name.removeprefix(package).strip(".").split(".") if name != package else []
    path = folder
    for i, part in enumerate(rest):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            module = path / f"{part}.py"
            tail = rest[i + 1 :]
            return not tail or (len(tail) == 1 and tail[0] in _defined_at_top(module))
        else:
            init = path / "__init__.py"
            return i == len(rest) - 1 and init.is_file() and part in _defined_at_top(init)
    return (path / "__init__.py").is_file()


def exists(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute path from the longest module in it."""
    for package, folder in FRAMEWORK_PACKAGES.items():
        if name == package or name.startswith(package + "."):
            return exists_in_source(name, package, folder)
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def in_the_wire_contract(name: str) -> bool:
    """A service or message of the .proto (``lossreduce.v2.ReductionCoordinator``)."""
    package, _, last = name.rpartition(".")
    return package == "lossreduce.v2" and bool(
        re.search(rf"^(?:service|message|enum) {re.escape(last)}\b", PROTO.read_text(), re.M)
    )


def test_exists_tells_real_names_from_made_up_ones() -> None:
    assert exists("lossreduce.status_codec.from_status")
    assert exists("lossreduce.trainer_worker.normalizers")
    assert not exists("lossreduce.status_codec.no_such_function")
    assert not exists("lossreduce.no_such_module")
    assert exists("lossreduce.trainer_worker.integrations.verl.plugin")
    assert exists("lossreduce.trainer_worker.integrations.areal")
    assert not exists("lossreduce.trainer_worker.integrations.areal.no_such_module")
    assert not exists("lossreduce.bench.frameworks.verl.no_such_name")
    assert exists("lossreduce.bench.frameworks.verl.run_verl_bench")
    assert exists("lossreduce.trainer_worker.cpu_standins.verl.env.CPU_ENV")
    assert not exists("lossreduce.trainer_worker.integrations.verl.cpu_platform")
    assert in_the_wire_contract("lossreduce.v2.ReductionCoordinator")
    assert not in_the_wire_contract("lossreduce.v2.NoSuchService")


def test_every_lossreduce_name_in_the_docs_exists() -> None:
    names = sorted(mentioned_names())
    assert len(names) > 20, names
    # In a process of its own: the names reach the train job and the TRL
    # integration, whose imports (Ray, transformers) must not stay loaded in
    # this test process.
    out = subprocess.run(
        [sys.executable, __file__, *names],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    absent = out.split()
    missing = sorted(n for n in absent if not in_the_wire_contract(n))
    assert not missing, f"named in the docs, but not in the code: {missing}"


if __name__ == "__main__":
    print("\n".join(name for name in sys.argv[1:] if not exists(name)))
