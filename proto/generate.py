"""Regenerate the Python binding of the v2 contract (`make proto`).

Writes ``coordinator_pb2.py``, ``coordinator_pb2.pyi`` and
``coordinator_pb2_grpc.py`` next to ``coordinator.proto``. The output depends
only on the ``.proto`` and the pinned grpcio-tools version, so
``tests/test_proto_binding.py`` can regenerate into a temporary folder and
fail when the committed files are stale.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("lossreduce/v2/coordinator.proto",)
GENERATED = (
    "lossreduce/v2/coordinator_pb2.py",
    "lossreduce/v2/coordinator_pb2.pyi",
    "lossreduce/v2/coordinator_pb2_grpc.py",
)


def _include_dirs() -> list[str]:
    import google.rpc  # googleapis-common-protos ships status.proto beside its binding

    well_known = resources.files("grpc_tools") / "_proto"
    googleapis = Path(next(iter(google.rpc.__path__))).parent.parent
    return [str(PROTO_ROOT), str(well_known), str(googleapis)]


def generate(out_dir: Path) -> None:
    """Run protoc over the contract, writing the binding under ``out_dir``."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc"]
    args += [f"-I{d}" for d in _include_dirs()]
    args += [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(PROTO_ROOT / f) for f in PROTO_FILES]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=PROTO_ROOT, help="output root (default: proto/)"
    )
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
