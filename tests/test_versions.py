"""The supported ranges (lossreduce._versions): what pyproject.toml declares, and
refused (or, for a newer torch, warned about) at import with the range to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from lossreduce._versions import (
    PROTOBUF_RANGE,
    PYTHON_RANGE,
    TORCH_RANGE,
    UnsupportedVersionError,
    UntestedVersionWarning,
    check_protobuf,
    check_python,
    check_torch,
    release_of,
)
from lossreduce.cli import TRAINER_MODULES

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _bounds(specifiers: SpecifierSet) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lower, upper) of a ``>=low,<high`` range, as release tuples without trailing zeros."""
    by_operator = {s.operator: s.version for s in specifiers}
    assert set(by_operator) == {">=", "<"}, f"not a >=,< range: {specifiers}"

    def release(version: str) -> tuple[int, ...]:
        parts = list(release_of(version))
        while len(parts) > 1 and parts[-1] == 0:
            parts.pop()
        return tuple(parts)

    return release(by_operator[">="]), release(by_operator["<"])


def _requirement(requirements: list[str], name: str) -> Requirement:
    (found,) = (r for r in map(Requirement, requirements) if r.name == name)
    return found


# -- the ranges are pyproject.toml's ------------------------------------------------


def test_python_range_is_requires_python() -> None:
    assert _bounds(SpecifierSet(PROJECT["requires-python"])) == PYTHON_RANGE


def test_protobuf_range_is_the_core_dependency() -> None:
    protobuf = _requirement(PROJECT["dependencies"], "protobuf")
    assert _bounds(protobuf.specifier) == PROTOBUF_RANGE


def test_torch_range_is_the_trainer_extra() -> None:
    torch = _requirement(PROJECT["optional-dependencies"]["trainer"], "torch")
    assert _bounds(torch.specifier) == TORCH_RANGE


def test_the_dispatcher_knows_every_module_of_the_trainer_extra() -> None:
    """``lossreduce train`` checks for these before importing anything (lossreduce.cli)."""
    extra = {Requirement(r).name for r in PROJECT["optional-dependencies"]["trainer"]}
    assert extra == set(TRAINER_MODULES)


# -- the checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.13.0+cu128", (2, 13, 0)), ("6.33.6", (6, 33, 6)), ("2.16.0.dev20260101", (2, 16, 0))],
)
def test_release_of_reads_the_leading_numbers(version: str, release: tuple[int, ...]) -> None:
    assert release_of(version) == release


def test_release_of_refuses_a_version_without_numbers() -> None:
    with pytest.raises(ValueError, match="'unknown'"):
        release_of("unknown")


@pytest.mark.parametrize("version", ["6.30.0", "6.33.6", "7.0.0", "7.36.2"])
def test_supported_protobuf_passes(version: str) -> None:
    check_protobuf(version)


@pytest.mark.parametrize("version", ["5.29.3", "6.29.5", "8.0.0", "8.1.0rc1"])
def test_unsupported_protobuf_names_the_version_and_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as raised:
        check_protobuf(version)
    assert f"protobuf {version} is installed" in str(raised.value)
    assert "protobuf>=6.30,<8" in str(raised.value)
    assert isinstance(raised.value, ImportError)


@pytest.mark.parametrize("version", ["2.10.0", "2.13.0+cpu", "2.15.1+cu128"])
def test_supported_torch_passes_silently(version: str) -> None:
    check_torch(version)  # any warning fails the test (filterwarnings = error)


@pytest.mark.parametrize("version", ["2.9.1+cu128", "2.4.0", "1.13.1"])
def test_older_torch_names_the_version_and_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as raised:
        check_torch(version)
    assert f"torch {version} is installed" in str(raised.value)
    assert "torch>=2.10,<2.16" in str(raised.value)


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0.dev20260101+cu130", "3.0.0"])
def test_newer_torch_warns_with_the_tested_range(version: str) -> None:
    with pytest.warns(UntestedVersionWarning, match=r"torch>=2\.10,<2\.16") as caught:
        check_torch(version)
    assert len(caught) == 1
    assert f"torch {version} is newer" in str(caught[0].message)


@pytest.mark.parametrize("version_info", [(3, 10, 0), (3, 11, 9), (3, 13, 5)])
def test_supported_python_passes(version_info: tuple[int, ...]) -> None:
    check_python(version_info)


@pytest.mark.parametrize("version_info", [(3, 9, 18), (2, 7, 18), (3, 14, 0)])
def test_unsupported_python_names_the_range(version_info: tuple[int, ...]) -> None:
    with pytest.raises(UnsupportedVersionError, match=r"Python >=3\.10,<3\.14"):
        check_python(version_info)


# -- at import, with the installed version string patched -------------------------


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_binding_refuses_an_old_protobuf_before_the_generated_code_runs() -> None:
    done = _child(
        """
        import google.protobuf
        google.protobuf.__version__ = "5.29.3"
        try:
            from lossreduce.v2 import coordinator_pb2
        except ImportError as error:
            print(type(error).__name__, error, sep=": ")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("UnsupportedVersionError: lossreduce needs protobuf>=6.30,<8;")
    assert "protobuf 5.29.3 is installed" in done.stdout


def test_the_console_script_prints_the_refusal_without_a_traceback() -> None:
    done = _child(
        """
        import sys
        import google.protobuf
        google.protobuf.__version__ = "8.0.0"
        from lossreduce.cli import main
        sys.exit(main(["serve", "--help"]))
        """
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("lossreduce serve: lossreduce needs protobuf>=6.30,<8;")
    assert "Traceback" not in done.stderr


def test_the_trainer_side_refuses_an_old_torch() -> None:
    done = _child(
        """
        import torch
        torch.__version__ = "2.9.1+cu128"
        try:
            import lossreduce.trainer_worker
        except ImportError as error:
            print(type(error).__name__, error, sep=": ")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "UnsupportedVersionError: lossreduce.trainer_worker needs torch>=2.10,<2.16;"
    )


def test_the_trainer_side_warns_once_on_a_newer_torch_at_the_importers_line() -> None:
    done = _child(
        """
        import warnings
        import torch
        torch.__version__ = "2.16.0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lossreduce.trainer_worker
        ours = [w for w in caught if w.category.__name__ == "UntestedVersionWarning"]
        for w in ours:
            print(w.filename, w.message, sep=": ")
        """
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    # Attributed to the user's import statement, not to lossreduce's own code.
    assert line.startswith("<string>: torch 2.16.0 is newer than the range")


def test_the_package_refuses_an_unsupported_python_first() -> None:
    """pip refuses to install on Python < 3.10; a source checkout on PYTHONPATH gets
    this instead of a failure of whichever import needs 3.10 first (checked by hand
    on real 3.7-3.9 interpreters; here the version is patched)."""
    done = _child(
        """
        import sys
        sys.version_info = (3, 9, 18, "final", 0)
        try:
            import lossreduce
        except ImportError as error:
            print(type(error).__name__, error, sep=": ")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "UnsupportedVersionError: lossreduce supports Python >=3.10,<3.14; this is Python 3.9.18"
    )
