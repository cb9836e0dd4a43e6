"""The Megatron tests need AReaL's ``[megatron]`` packages (Megatron-Core 0.17.0 and mbridge
0.15.1, Python >= 3.12; ``make test-megatron`` builds ``.venv-megatron``): in any other
environment (``.venv-areal``) they are skipped. Only the spawned ranks import Megatron,
so its import-time warnings never reach the test process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is absent
        return False


HAVE_MEGATRON = _importable("megatron.core") and _importable("mbridge")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_MEGATRON:
        return
    skip = pytest.mark.skip(
        reason="needs megatron-core 0.17.0 and mbridge 0.15.1 (AReaL's [megatron] extra, "
        "Python >= 3.12): make test-megatron"
    )
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(skip)
