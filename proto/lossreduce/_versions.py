"""The supported ranges of Python, protobuf and torch, checked when lossreduce loads.

pip enforces the declared ranges (pyproject.toml) on install, but an environment can
drift afterwards (``pip install -U protobuf``, another package's torch pin). Without a
check the failure surfaces far from its cause: protobuf's generated-code ``VersionError``
deep in an import chain, or an attribute missing from an old torch at some step. Each
check here refuses (or, for an untested newer torch, warns) at import, naming the
installed version and the range to install.

The ranges live only here; ``tests/test_versions.py`` checks that they agree with
pyproject.toml. This module runs before anything else of the package, so it keeps to
syntax and imports every Python release can at least parse up to the version check.
"""

from __future__ import annotations

import re
import sys
import warnings

__all__ = [
    "PROTOBUF_RANGE",
    "PYTHON_RANGE",
    "TORCH_RANGE",
    "TRAINER_INSTALL",
    "UnsupportedVersionError",
    "UntestedVersionWarning",
    "check_protobuf",
    "check_python",
    "check_torch",
    "release_of",
    "spec",
]

PYTHON_RANGE = ((3, 10), (3, 14))
"""``requires-python``: at least the first, below the second."""

PROTOBUF_RANGE = ((6, 30), (8,))
"""The ``protobuf`` dependency: the committed binding's gencode (6.30.0) needs at least
6.30; protobuf 8 is a major release the binding was never generated against."""

TORCH_RANGE = ((2, 10), (2, 16))
"""The trainer extra's ``torch``: the releases the test matrix covers."""

TRAINER_INSTALL = "pip install 'lossreduce[trainer]'"
"""What installs the trainer side (torch, Ray, rich, matplotlib, cryptography)."""


class UnsupportedVersionError(ImportError):
    """An installed dependency (or Python) is outside lossreduce's supported range.

    An ``ImportError``, so code that guards an optional import keeps working; the
    ``lossreduce`` command prints the message instead of a traceback.
    """


class UntestedVersionWarning(UserWarning):
    """An installed dependency is newer than the range lossreduce is tested with."""


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in release)


def spec(package: str, supported: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    """The range as a pip requirement, e.g. ``protobuf>=6.30,<8``."""
    low, high = supported
    return f"{package}>={_dotted(low)},<{_dotted(high)}"


def release_of(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``2.13.0+cu128`` -> (2, 13, 0).

    Local labels (``+cpu``), pre- and dev-release suffixes are ignored, so a nightly of
    2.16 counts as 2.16: ``packaging`` is not a dependency, and a release-level
    comparison is all these ranges need.
    """
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"version {version!r} does not start with a release number")
    return tuple(int(part) for part in match.group().split("."))


def _compare(release: tuple[int, ...], bound: tuple[int, ...]) -> int:
    """-1, 0 or 1 as ``release`` is below, at or above ``bound`` (zero-padded)."""
    width = max(len(release), len(bound))
    a = release + (0,) * (width - len(release))
    b = bound + (0,) * (width - len(bound))
    return (a > b) - (a < b)


def check_python(version_info: tuple[int, ...] = tuple(sys.version_info[:3])) -> None:
    """Refuse a Python outside ``requires-python`` (pip does on install; a source
    checkout on ``PYTHONPATH`` does not go through pip)."""
    low, high = PYTHON_RANGE
    if _compare(version_info, low) < 0 or _compare(version_info, high) >= 0:
        raise UnsupportedVersionError(
            f"lossreduce supports Python >={_dotted(low)},<{_dotted(high)}; "
            f"this is Python {_dotted(version_info)}"
        )


def check_protobuf(version: str) -> None:
    """Refuse a protobuf runtime the generated binding (``lossreduce.v2``) cannot load on."""
    low, high = PROTOBUF_RANGE
    release = release_of(version)
    if _compare(release, low) < 0 or _compare(release, high) >= 0:
        wanted = spec("protobuf", PROTOBUF_RANGE)
        raise UnsupportedVersionError(
            f"lossreduce needs {wanted}; protobuf {version} is installed. "
            f"Install a supported release: pip install '{wanted}'"
        )


def check_torch(version: str) -> None:
    """Refuse a torch older than the trainer side supports; warn once on a newer one.

    An older torch lacks what the engines use; a newer one is merely untested, so it
    runs, with one warning (Python shows a given warning once per call site).
    """
    low, high = TORCH_RANGE
    release = release_of(version)
    wanted = spec("torch", TORCH_RANGE)
    if _compare(release, low) < 0:
        raise UnsupportedVersionError(
            f"lossreduce.trainer_worker needs {wanted}; torch {version} is installed. "
            f"Install a supported release: pip install '{wanted}'"
        )
    if _compare(release, high) >= 0:
        warnings.warn(
            f"torch {version} is newer than the range lossreduce is tested with ({wanted})",
            UntestedVersionWarning,
            stacklevel=3,
        )
