"""The Megatron tests need AReaL's ``[megatron]`` packages (Megatron-Core 0.17.0 and mbridge
0.15.1, Python >= 3.12; ``make test-megatron`` builds ``.venv-megatron``): in any other
environment (``.venv-areal``) they are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_worker.integrations.megatron_support import skip_without_megatron


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_without_megatron(
        items,
        Path(__file__).resolve().parent,
        "needs megatron-core 0.17.0 and mbridge 0.15.1 (AReaL's [megatron] extra, "
        "Python >= 3.12): make test-megatron",
    )
