"""tests/install: pip's resolutions of the framework stacks (``stacks.py``).

The tests that resolve live (those using the ``resolutions`` fixture:
``test_resolution.py``) wait on the package index (network, minutes), so a run skips
them, saying how to run them, unless ``LOSSREDUCE_RESOLUTION=1`` opts in (``make
test-resolve``); they carry the ``resolution`` marker. The check of the committed record
(``test_resolution_report.py``: seconds, offline) always runs.

``resolutions`` (session): every stack and fact the session selected, resolved once,
:data:`JOBS` at a time; the table of ``stacks.py`` is printed at the end of the run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.install import stacks

OPT_IN = "LOSSREDUCE_RESOLUTION"
HERE = Path(__file__).resolve().parent
JOBS = int(os.environ.get("LOSSREDUCE_RESOLUTION_JOBS", "2"))
"""Resolutions at a time (mostly waiting on the network)."""

Results = tuple[
    list[stacks.Outcome], list[tuple[stacks.Unresolvable, stacks.Resolution | stacks.Failure]]
]
RESULTS = pytest.StashKey[Results]()


def param_id(entry: stacks.Stack | stacks.Unresolvable) -> str:
    """A test id for a stack or fact (``verl-vllm-py3.11``): no brackets for ``-k``."""
    return re.sub(r"\W+", "-", entry.name).strip("-") + f"-py{entry.python}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "resolution: resolves framework stacks with pip against the package index "
        f"(slow, network); opt in with {OPT_IN}=1 (make test-resolve)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(
        reason=f"pip resolutions against the package index (minutes, network): run them with "
        f"`make test-resolve` or `{OPT_IN}=1 .venv/bin/pytest tests/install`"
    )
    for item in items:
        if HERE in item.path.parents and "resolutions" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.resolution)
            if os.environ.get(OPT_IN) != "1":
                item.add_marker(skip)


@pytest.fixture(scope="session")
def resolutions(request: pytest.FixtureRequest) -> Results:
    """The resolutions of every stack and fact a selected test asks for, run together."""
    chosen: list[stacks.Stack] = []
    facts: list[stacks.Unresolvable] = []
    for item in request.session.items:
        for value in getattr(getattr(item, "callspec", None), "params", {}).values():
            if isinstance(value, stacks.Stack) and value not in chosen:
                chosen.append(value)
            elif isinstance(value, stacks.Unresolvable) and value not in facts:
                facts.append(value)
    results = stacks.run_all(chosen, facts, JOBS)
    request.config.stash[RESULTS] = results
    return results


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    results = config.stash.get(RESULTS, None)
    if results is not None:
        terminalreporter.section("pip resolutions (tests/install/stacks.py)")
        terminalreporter.write_line(stacks.report(*results)[0])
