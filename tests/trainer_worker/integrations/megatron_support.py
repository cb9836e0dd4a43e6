"""Megatron test folders (AReaL's, verl's) run only where Megatron-Core and mbridge are
installed, each in an environment of its own; anywhere else their tests are skipped
(never collected and failed). Only spawned ranks and launches import Megatron, so its
import-time warnings never reach the test process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

__all__ = ["HAVE_MEGATRON", "skip_without_megatron"]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is absent
        return False


HAVE_MEGATRON = _importable("megatron.core") and _importable("mbridge")


def skip_without_megatron(items: list[pytest.Item], folder: Path, reason: str) -> None:
    """Mark every test under ``folder`` skipped for ``reason`` unless Megatron is here."""
    if HAVE_MEGATRON:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.path.is_relative_to(folder):
            item.add_marker(skip)
