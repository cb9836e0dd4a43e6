"""The warnings that importing AReaL 1.0.4 raises, filtered as the integration's tests filter
them (the driver of ``--engine areal`` imports AReaL; everything else stays an error)."""

import pytest

from tests.trainer_worker.integrations.areal.conftest import AREAL_IMPORT_WARNINGS


def pytest_configure(config: pytest.Config) -> None:
    for line in AREAL_IMPORT_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
