"""Fixtures for the tests of ``deploy/``: the folder, its parsed files, the
Prometheus binaries.

The Prometheus tests skip where the binaries are missing on a developer's
machine, but fail under CI (``CI`` set), where ``.ci/run`` installs Debian's
``prometheus`` package: a missing binary there must not pass as a skip.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"


MISSING_BINARY = "is not on PATH; install Debian's 'prometheus' package"
"""In the skip reason of every test that needs a Prometheus binary that is missing."""

INSTALL_LINE = "apt-get install -y --no-install-recommends prometheus"
"""How .ci/run installs both binaries."""


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name!r} {MISSING_BINARY}"
        if os.environ.get("CI"):
            pytest.fail(message + " (.ci/run does)")
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def deploy_dir() -> Path:
    return DEPLOY_DIR


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return _binary("prometheus")


@pytest.fixture(scope="session")
def prometheus_config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY_DIR / "prometheus/prometheus.yml").read_text())
    return loaded


@pytest.fixture(scope="session")
def alert_rules() -> list[dict[str, Any]]:
    """Every rule of ``alerts.yml`` (all groups)."""
    doc = yaml.safe_load((DEPLOY_DIR / "prometheus/alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEPLOY_DIR / "grafana/lossreduce.json").read_text())
    return loaded


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say at the end of the run, not only in ``-ra``'s list, how many tests the missing
    binaries skipped and how to install them: a skip must not read as a pass."""
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if MISSING_BINARY in str(getattr(report, "longrepr", ""))
    ]
    if skipped:
        terminalreporter.write_sep(
            "-", f"{len(skipped)} Prometheus tests skipped: prometheus or promtool is missing"
        )
        terminalreporter.write_line(f"install both as .ci/run does: {INSTALL_LINE}")
