"""The committed gRPC binding must be what `make proto` generates today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "_lossreduce_proto_generate", ROOT / "proto" / "generate.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_committed_binding_matches_regenerated(tmp_path: Path) -> None:
    generator = _load_generator()
    generator.generate(tmp_path)
    stale = [
        rel
        for rel in generator.GENERATED
        if (tmp_path / rel).read_bytes() != (ROOT / "proto" / rel).read_bytes()
    ]
    assert not stale, f"stale generated files {stale}: run `make proto` and commit the result"


def test_binding_imports_under_package_name() -> None:
    from lossreduce.v2 import coordinator_pb2, coordinator_pb2_grpc

    assert coordinator_pb2.DESCRIPTOR.package == "lossreduce.v2"
    assert hasattr(coordinator_pb2_grpc, "ReductionCoordinatorServicer")
    assert {
        m.name for m in coordinator_pb2.DESCRIPTOR.services_by_name["ReductionCoordinator"].methods
    } >= {
        "Reduce",
        "ReduceStream",
        "GetRound",
    }


@pytest.mark.parametrize("name", ["server", "client", "proto", "trainer_worker", "bench"])
def test_no_generic_top_level_module_installed(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Import from a neutral folder so the source tree is not on sys.path.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    spec = importlib.util.find_spec(name)
    assert spec is None or ("site-packages" in str(spec.origin) and name == "proto"), (
        f"a top-level module {name!r} is importable from {spec.origin if spec else None}"
    )
