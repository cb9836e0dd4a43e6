"""Every integration has a row in the contract table, and its lane runs it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.contract import checks
from tests.contract.table import ROWS

ROOT = Path(__file__).resolve().parents[2]
INTEGRATIONS = ROOT / "trainer_worker" / "integrations"


def test_every_integration_has_a_row() -> None:
    frameworks = {p.name for p in INTEGRATIONS.iterdir() if (p / "__init__.py").is_file()}
    rows = {name.split("-")[0] for name in ROWS}
    assert frameworks == rows


def test_every_rows_lane_module_runs_every_column() -> None:
    columns = set(checks.__all__)
    for name, module in ROWS.items():
        path = ROOT / module
        assert path.is_file(), f"row {name!r}: {module} is missing"
        tree = ast.parse(path.read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "tests.contract.checks"
            for alias in node.names
        }
        assert imported == columns or "*" in imported, f"row {name!r} runs {sorted(imported)}"
        fixtures = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name == "contract"
        }
        assert fixtures == {"contract"}, f"row {name!r}: no `contract` fixture in {module}"
