"""The import rules of docs/development.md, checked on the source (no import runs).

Every ``import`` and ``from ... import`` of every module of the installed
packages is read with :mod:`ast` — also those inside functions, which run
lazily but still run, and those under ``if TYPE_CHECKING:``, which only the
type checker follows and which are therefore exempt.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PACKAGE_DIRS = {
    "lossreduce": ROOT / "proto" / "lossreduce",
    "lossreduce.server": ROOT / "server",
    "lossreduce.bench": ROOT / "bench",
    "lossreduce.client": ROOT / "client",
    "lossreduce.trainer_worker": ROOT / "trainer_worker",
}
"""setuptools' ``package-dir`` mapping (pyproject.toml), import name -> folder."""

GRPC = ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "google.protobuf", "lossreduce.v2")
RAY = ("ray",)
FRAMEWORKS = (
    "trl",
    "transformers",
    "accelerate",
    "datasets",
    "verl",
    "areal",
    "peft",
    "megatron",
    "mbridge",
)
TRAIN = "lossreduce.trainer_worker.train"
INTEGRATIONS = "lossreduce.trainer_worker.integrations"
ENGINES = f"{TRAIN}.engines"
CPU_STANDINS = "lossreduce.trainer_worker.cpu_standins"
"""What exists only so that frameworks run without a GPU (tests, benches, the demo)."""
BENCH = "lossreduce.bench"

ROUND_TABLE = tuple(
    f"lossreduce.server.{m}"
    for m in (
        "round_table",
        "validation",
        "summation",
        "records",
        "step_window",
        "outcomes",
        "refusals",
        "run_claims",
        "rounds",
    )
)
"""The pure round state machine and what it is made of."""


def _module_name(path: Path) -> str:
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(str(kv[1]))):
        if path.is_relative_to(folder):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise AssertionError(f"{path} is in no package")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module ``source`` (the text of ``module``) imports at run time."""

    def walk(nodes: list[ast.stmt] | list[ast.AST]) -> Iterator[ast.AST]:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                yield from walk(node.orelse)
                continue
            yield node
            yield from walk(list(ast.iter_child_nodes(node)))

    package = module if is_package else module.rpartition(".")[0]
    for node in walk(ast.parse(source).body):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            yield stem
            # `from pkg import sub` may import a submodule: count both names.
            yield from (f"{stem}.{alias.name}" for alias in node.names)


def _modules() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_DIRS.values():
        for path in folder.rglob("*.py"):
            if "_pb2" in path.name:
                continue
            name = _module_name(path)
            found[name] = set(
                imports_of(path.read_text(), name, is_package=path.name == "__init__.py")
            )
    return found


MODULES = _modules()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(
    importers: tuple[str, ...],
    forbidden: tuple[str, ...],
    *,
    exempt: tuple[str, ...] = (),
    exactly: bool = False,
) -> list[str]:
    """``module -> import`` for every module under ``importers`` (or, ``exactly``, among
    them), less those under ``exempt``, that imports something under ``forbidden``."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in MODULES.items()
        if (module in importers if exactly else _within(module, importers))
        and not _within(module, exempt)
        for target in targets
        if _within(target, forbidden)
    )


def test_the_checker_reads_the_whole_tree() -> None:
    assert {
        "lossreduce.server.round_table",
        "lossreduce.client.aio",
        f"{ENGINES}.registry",
        f"{BENCH}.cli",
        f"{BENCH}.frameworks.verl",
        f"{CPU_STANDINS}.verl.platform",
        f"{CPU_STANDINS}.megatron.platform",
    } <= set(MODULES)
    assert "lossreduce.v2" in MODULES["lossreduce.server.servicer"] or any(
        t.startswith("lossreduce.v2") for t in MODULES["lossreduce.server.servicer"]
    )


def test_the_checker_sees_lazy_relative_and_guarded_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n    import ray\n"
        "def f():\n    import grpc\n"
    )
    got = set(imports_of(source, "lossreduce.server.mod"))
    assert {"lossreduce.server", "lossreduce.server.sibling", "grpc"} <= got
    assert "ray" not in got


def test_the_round_table_imports_no_grpc() -> None:
    assert violations(ROUND_TABLE, GRPC) == []


def test_the_reduction_core_imports_no_grpc_ray_client_or_framework() -> None:
    core = ("lossreduce.trainer_worker",)
    forbidden = (*GRPC, *RAY, *FRAMEWORKS, "lossreduce.client", "lossreduce.server")
    assert violations(core, forbidden, exempt=(TRAIN, INTEGRATIONS, CPU_STANDINS)) == []


def test_the_client_imports_neither_the_server_nor_the_trainer_worker() -> None:
    forbidden = ("lossreduce.server", "lossreduce.trainer_worker")
    assert violations(("lossreduce.client",), forbidden) == []


def test_the_server_imports_neither_the_client_nor_the_trainer_worker() -> None:
    forbidden = ("lossreduce.client", "lossreduce.trainer_worker", BENCH)
    assert violations(("lossreduce.server",), forbidden) == []


def test_nothing_imports_the_bench_but_the_bench() -> None:
    """The ``lossreduce`` command's dispatcher reaches it by module name, which is no
    import; the bench itself may import anything of lossreduce."""
    assert violations(("lossreduce",), (BENCH,), exempt=(BENCH,)) == []


def _module_names_in(path: Path) -> set[str]:
    """The string constants of ``path`` that name a lossreduce module."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("lossreduce.")
    }


def test_modules_loaded_by_name_exist() -> None:
    """What is imported by a string, not an import statement: the commands of the
    dispatcher, and the stand-ins verl loads through ``VERL_USE_EXTERNAL_MODULES`` (its
    CPU platform, the CPU rollout, the Megatron engine's stand-ins)."""
    dispatched = _module_names_in(ROOT / "proto/lossreduce/cli.py")
    assert f"{BENCH}.cli" in dispatched
    assert dispatched - set(MODULES) == set()
    verl_loads = _module_names_in(ROOT / "trainer_worker/cpu_standins/verl/env.py")
    assert {
        f"{CPU_STANDINS}.verl.platform",
        f"{CPU_STANDINS}.verl.rollout",
        f"{CPU_STANDINS}.verl.megatron",
    } == verl_loads
    assert verl_loads <= set(MODULES)


def test_only_the_train_job_integrations_stand_ins_and_bench_touch_ray_or_a_framework() -> None:
    exempt = (TRAIN, INTEGRATIONS, CPU_STANDINS, BENCH)
    assert violations(("lossreduce",), (*RAY, *FRAMEWORKS), exempt=exempt) == []


def test_no_integration_imports_the_cpu_stand_ins() -> None:
    """A production launch imports an integration, never what exists only for machines
    without a GPU; the train job, the benches and the tests may."""
    assert violations((INTEGRATIONS,), (CPU_STANDINS,)) == []


def test_the_cpu_stand_ins_never_import_the_train_job_or_the_bench() -> None:
    assert violations((CPU_STANDINS,), (TRAIN, BENCH)) == []


def test_an_integration_never_imports_the_train_job() -> None:
    assert violations((INTEGRATIONS,), (TRAIN,)) == []


def _subpackages(parent: str) -> list[str]:
    depth = parent.count(".") + 1
    return sorted(
        {
            ".".join(m.split(".")[: depth + 1])
            for m in MODULES
            if m.startswith(parent + ".") and m.count(".") > depth
        }
    )


@pytest.mark.parametrize("integration", _subpackages(INTEGRATIONS))
def test_one_integration_never_imports_another(integration: str) -> None:
    others = tuple(i for i in _subpackages(INTEGRATIONS) if i != integration)
    assert violations((integration,), others) == []


@pytest.mark.parametrize("engine", _subpackages(ENGINES))
def test_one_engine_never_imports_another(engine: str) -> None:
    others = tuple(e for e in _subpackages(ENGINES) if e != engine)
    assert violations((engine,), others) == []


def test_the_shared_train_job_never_names_an_engine() -> None:
    """Driver, placement, coordinator actor, agents, TLS, outputs: only the engine
    interface and the registry."""
    shared = tuple(m for m in MODULES if _within(m, (TRAIN,)) and not _within(m, (ENGINES,)))
    engines = tuple(_subpackages(ENGINES))
    assert engines, "no engine packages found"
    assert violations(shared, engines, exactly=True) == []
    # The interface and the registry (which names packages as strings) import none.
    assert violations((f"{ENGINES}.base", f"{ENGINES}.registry"), engines) == []


BACKENDS = ("LocalNormalizer", "TorchDistributedNormalizer", "CoordinatorNormalizer")
"""The normalizer backends: only :mod:`~lossreduce.trainer_worker.normalizers`, one
worker's rounds and the bench build them."""
BUILDS_BACKENDS = (
    "lossreduce.trainer_worker.normalizers",
    f"{INTEGRATIONS}.worker_rounds",
    BENCH,
)


def backends_built(source: str) -> set[str]:
    """The backend classes ``source`` calls (by name or as an attribute)."""
    called = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in BACKENDS:
                called.add(name)
    return called


def test_only_a_workers_rounds_build_a_normalizer_backend() -> None:
    """Every worker (verl, AReaL, TRL, SkyRL, the torch engine) takes its backend from
    :class:`~lossreduce.trainer_worker.integrations.worker_rounds.WorkerRounds`."""
    built = {
        _module_name(path): sorted(backends_built(path.read_text()))
        for folder in PACKAGE_DIRS.values()
        for path in folder.rglob("*.py")
        if "_pb2" not in path.name
    }
    outside = {m: b for m, b in built.items() if b and not _within(m, BUILDS_BACKENDS)}
    assert outside == {}
    assert built[f"{INTEGRATIONS}.worker_rounds"] == sorted(BACKENDS)


def test_the_backend_check_sees_a_call() -> None:
    assert backends_built("x = n.LocalNormalizer(job='j')\nTorchDistributedNormalizer()") == {
        "LocalNormalizer",
        "TorchDistributedNormalizer",
    }
    assert backends_built("from m import LocalNormalizer") == set()
