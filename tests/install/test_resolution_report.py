"""The committed resolutions (``resolutions.json``) are current and pass the live checks.

Seconds and offline, so the main run has it (``test_resolution.py`` resolves live, opt-in):
the record must have been resolved from today's inputs (pyproject.toml, constraints/,
stacks.py: a change fails here, naming the files and the command that re-resolves), cover
exactly the stacks and facts of ``stacks.py``, and pass the same checks the live tests
make (``resolution_report.stack_problems``/``fact_problems``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.install import resolution_report as record
from tests.install import stacks
from tests.install.conftest import param_id

REPORT = record.load()


def _fail_on(problems: list[str]) -> None:
    if problems:
        pytest.fail("\n".join([*problems, f"(recorded in {record.REPORT})"]), pytrace=False)


def test_the_record_is_resolved_from_the_current_inputs() -> None:
    reason = record.staleness(REPORT["inputs"])
    if reason:
        pytest.fail(reason, pytrace=False)


def test_the_record_covers_every_stack_and_fact() -> None:
    problems: list[str] = []
    for kind, recorded, defined in (
        ("stacks", REPORT["stacks"].keys(), {s.id for s in stacks.STACKS}),
        ("unresolvable", REPORT["unresolvable"].keys(), {u.id for u in stacks.UNRESOLVABLE}),
    ):
        if defined - recorded:
            problems.append(f"{kind} not recorded: {', '.join(sorted(defined - recorded))}")
        if recorded - defined:
            problems.append(
                f"{kind} recorded, not defined: {', '.join(sorted(recorded - defined))}"
            )
    if problems:
        _fail_on([*problems, f"re-resolve: {record.COMMAND}"])


@pytest.mark.parametrize("stack", stacks.STACKS, ids=param_id)
def test_lossreduce_installs_into_the_stack_unchanged(stack: stacks.Stack) -> None:
    if stack.id not in REPORT["stacks"]:
        pytest.fail(f"{stack.id} is not recorded: run {record.COMMAND}", pytrace=False)
    _fail_on(record.stack_problems(stack, REPORT["stacks"][stack.id]))


@pytest.mark.parametrize("fact", stacks.UNRESOLVABLE, ids=param_id)
def test_the_install_does_not_resolve_even_alone(fact: stacks.Unresolvable) -> None:
    if fact.id not in REPORT["unresolvable"]:
        pytest.fail(f"{fact.id} is not recorded: run {record.COMMAND}", pytrace=False)
    _fail_on(record.fact_problems(fact, REPORT["unresolvable"][fact.id]))


def test_a_changed_input_makes_the_record_stale(tmp_path: Path) -> None:
    """On a copy of the inputs: each change is named, with the command that re-resolves."""
    for path in record.input_files():
        copy = tmp_path / path.relative_to(stacks.REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
    inputs = record.hash_inputs(tmp_path)
    assert inputs["files"].keys() == REPORT["inputs"]["files"].keys()
    assert record.staleness(inputs, tmp_path) is None
    pyproject = tmp_path / "pyproject.toml"
    # The test and lint settings are no input: a resolution never reads them.
    with pyproject.open("a", encoding="utf-8") as file:
        file.write("# a comment\n[tool.pytest.ini_options.another]\nkey = 1\n")
    assert record.staleness(inputs, tmp_path) is None
    text = pyproject.read_text(encoding="utf-8")
    pyproject.write_text(text.replace('requires-python = "', 'requires-python = "!=3.9.0,'))
    (tmp_path / "constraints" / "new.txt").write_text("torch==2.10.0\n", encoding="utf-8")
    reason = record.staleness(inputs, tmp_path)
    assert reason is not None
    assert "changed since: constraints/new.txt, pyproject.toml." in reason
    assert reason.endswith(record.COMMAND)


def test_a_recorded_change_of_a_watched_version_fails() -> None:
    stack = stacks.STACKS[0]
    together = REPORT["stacks"][stack.id]["together"]
    assert isinstance(together, dict)
    moved = record.StackRecord(
        alone=REPORT["stacks"][stack.id]["alone"],
        together={**together, "torch": "0.0.1"},
        other_moved={},
    )
    (problem,) = record.stack_problems(stack, moved)
    assert f"{stack.id}: adding lossreduce changes torch " in problem
    assert problem.endswith(" -> 0.0.1")
