"""``lossreduce.server.__all__`` is the public surface, and it is honest."""

from __future__ import annotations

from lossreduce import server


def test_all_names_exist_once() -> None:
    for name in server.__all__:
        assert hasattr(server, name), name
    assert len(set(server.__all__)) == len(server.__all__)


def test_the_documented_entry_points_are_exported() -> None:
    assert {
        "CoordinatorSettings",
        "CoordinatorThread",
        "serve",
        "RoundTable",
        "Outcome",
        "OutcomeKind",
        "OutcomeStore",
        "RoundKey",
    } <= set(server.__all__)
