"""The verl Megatron tests need verl's Megatron engine: Megatron-Core and mbridge (verl's
``mcore`` extra), Python 3.12 here (``make test-verl-megatron`` builds
``.venv-verl-megatron``); in any other environment (``.venv-verl``) they are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_worker.integrations.megatron_support import skip_without_megatron


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_without_megatron(
        items,
        Path(__file__).resolve().parent,
        "needs verl's Megatron engine (megatron-core and mbridge, verl's mcore extra): "
        "make test-verl-megatron",
    )
