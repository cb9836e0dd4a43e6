"""AReaL's own import-time warnings, filtered one by one (everything else stays an error)."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # AReaL warns on import that NVIDIA's Transformer Engine and Apex are absent (CPU).
        item.add_marker(
            pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed")
        )
