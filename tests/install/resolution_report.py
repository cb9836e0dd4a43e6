"""The committed outcome of the resolution matrix (``resolutions.json``) and its checks.

The live resolutions of ``stacks.py`` take 5-10 minutes against the package index, yet
what they find only changes when their inputs do (:func:`input_files`: the ranges of
pyproject.toml, constraints/, the stack definitions of stacks.py) or when the index
publishes new releases (which ``make test-resolve`` still catches). So their outcome is
committed with a sha256 of those inputs, and the main test run checks that record instead
(``test_resolution_report.py``: seconds, no network): the inputs must hash as recorded,
and the recorded outcome must pass the checks the live tests make
(:func:`stack_problems`, :func:`fact_problems`: one code for both).

Rewrite the record from live resolutions (from the repository root, after changing an
input; stdlib only, any Python 3.10+)::

    python -m tests.install.resolution_report [--jobs N] [--only verl[vllm]@3.12 ...]

It resolves every stack and fact with :func:`stacks.run_all` (``--only``: those named,
merged into a record of the same inputs, e.g. after a network error), writes the record,
prints the table of ``stacks.py`` and exits 1 when a check fails: the record is written
either way (it is what pip found; the fast check then fails on it), but not when an input
changed while pip was resolving.

The record, per stack id (``verl[vllm]@3.11``): ``alone`` and ``together`` (with
``lossreduce[extra]``), each the versions of the :data:`stacks.WATCHED` packages and of
lossreduce in pip's install list, or pip's one-line reason as a string when pip failed;
``other_moved``: any other version adding lossreduce moved (``null``: removed). Per
unresolvable fact, the same: pip's reason, or the versions if it resolves now.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

from tests.env_key import installed_tables
from tests.install import stacks

REPORT = Path(__file__).with_name("resolutions.json")
COMMAND = "python -m tests.install.resolution_report"
"""What rewrites :data:`REPORT` (from the repository root)."""

Side = dict[str, str] | str
"""One resolution: {canonical name: version} of the packages recorded, or pip's reason."""


class Inputs(TypedDict):
    sha256: str  # over every input's path and sha256: a renamed or removed file counts too
    files: dict[str, str]  # {path relative to the repository: sha256}, to name what changed


class StackRecord(TypedDict):
    alone: Side
    together: Side
    other_moved: dict[str, list[str | None]]


class Report(TypedDict):
    written_by: str
    resolved_on: str
    inputs: Inputs
    stacks: dict[str, StackRecord]
    unresolvable: dict[str, Side]


def input_files(repo: Path = stacks.REPO) -> list[Path]:
    """What the resolutions depend on besides the index: pyproject.toml (lossreduce's
    ranges and extras: the tables an install reads), every file of constraints/ and the
    stack definitions (stacks.py)."""
    constraints = (p for p in (repo / "constraints").rglob("*") if p.is_file())
    return [repo / "pyproject.toml", *sorted(constraints), repo / "tests/install/stacks.py"]


def _content(path: Path) -> bytes:
    # Of pyproject.toml, what an install reads (its ranges, extras and layout): its test,
    # lint and type-check settings change no resolution.
    text = path.read_bytes()
    return installed_tables(text) if path.name == "pyproject.toml" else text


def hash_inputs(repo: Path = stacks.REPO) -> Inputs:
    """The sha256 of each of :func:`input_files` and one over them all."""
    files = {
        path.relative_to(repo).as_posix(): hashlib.sha256(_content(path)).hexdigest()
        for path in input_files(repo)
    }
    listing = "".join(f"{name}\0{digest}\n" for name, digest in sorted(files.items()))
    return Inputs(sha256=hashlib.sha256(listing.encode()).hexdigest(), files=files)


def staleness(recorded: Inputs, repo: Path = stacks.REPO) -> str | None:
    """Why the record no longer matches the inputs in ``repo`` (and how to rewrite it),
    or None while it does."""
    current = hash_inputs(repo)
    if current["sha256"] == recorded["sha256"]:
        return None
    old, new = recorded["files"], current["files"]
    changed = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
    return (
        f"{REPORT.name} was resolved from other inputs: changed since: "
        f"{', '.join(changed) or '(the recorded hash alone)'}. Re-resolve (5-10 minutes, "
        f"network) and commit the result: {COMMAND}"
    )


def side(result: stacks.Resolution | stacks.Failure) -> Side:
    """What the record keeps of one resolution: the watched versions and lossreduce's."""
    if isinstance(result, stacks.Failure):
        return result.error.reason
    kept = (*stacks.WATCHED, "lossreduce")
    return {name: version for name, version in result.versions.items() if name in kept}


def stack_record(outcome: stacks.Outcome) -> StackRecord:
    return StackRecord(
        alone=side(outcome.alone),
        together=side(outcome.together),
        other_moved={name: [old, new] for name, (old, new) in outcome.other_changes.items()},
    )


def build(
    outcomes: Sequence[stacks.Outcome],
    facts: Sequence[tuple[stacks.Unresolvable, stacks.Resolution | stacks.Failure]],
    inputs: Inputs,
) -> Report:
    return Report(
        written_by=COMMAND,
        resolved_on=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        inputs=inputs,
        stacks={o.stack.id: stack_record(o) for o in outcomes},
        unresolvable={fact.id: side(result) for fact, result in facts},
    )


def dumps(report: Report) -> str:
    """Sorted keys and one value a line: a re-resolution's diff shows what moved."""
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def load(path: Path = REPORT) -> Report:
    report: Report = json.loads(path.read_text(encoding="utf-8"))
    return report


def stack_problems(stack: stacks.Stack, record: StackRecord) -> list[str]:
    """Why lossreduce does not install into ``stack`` unchanged (empty: it does): both
    resolutions succeed, the second installs lossreduce, the first has torch, and every
    watched package of the first keeps its version."""
    alone, together = record["alone"], record["together"]
    if isinstance(alone, str) or isinstance(together, str):
        return [
            f"{stack.id}: pip fails {label}: {result}"
            for label, result in (("alone", alone), (f"with lossreduce[{stack.extra}]", together))
            if isinstance(result, str)
        ]
    problems: list[str] = []
    if "lossreduce" not in together:
        problems.append(
            f"{stack.id}: lossreduce[{stack.extra}] did not put lossreduce in the install list"
        )
    if "lossreduce" in alone:
        problems.append(f"{stack.id}: the stack alone installs lossreduce")
    if "torch" not in alone:
        problems.append(f"{stack.id}: the stack resolved without torch")
    moved = [
        f"{name} {old} -> {together.get(name) or 'removed'}"
        for name, old in sorted(alone.items())
        if name in stacks.WATCHED and together.get(name) != old
    ]
    if moved:
        problems.append(f"{stack.id}: adding lossreduce changes {', '.join(moved)}")
    return problems


def fact_problems(fact: stacks.Unresolvable, result: Side) -> list[str]:
    """Why ``fact`` no longer holds (empty: it does): pip fails, for the expected reason."""
    if not isinstance(result, str):
        return [f"{fact.id}: {' '.join(fact.specs)} resolves now: move it to STACKS"]
    if fact.expect not in result:
        return [f"{fact.id}: pip's reason no longer says {fact.expect!r}: {result}"]
    return []


def problems(report: Report) -> list[str]:
    """Every check of :func:`stack_problems` and :func:`fact_problems` over ``report``."""
    found = [
        problem for stack in stacks.STACKS
        for problem in stack_problems(stack, report["stacks"][stack.id])
    ]  # fmt: skip
    for fact in stacks.UNRESOLVABLE:
        found += fact_problems(fact, report["unresolvable"][fact.id])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Rewrite {REPORT.name} from live resolutions.")
    parser.add_argument(
        "--jobs", type=int, default=2, help="resolutions at a time (default 2: network-bound)"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="ID",
        help="re-resolve only this stack or fact (verl[vllm]@3.12), e.g. after a network "
        "error, keeping the rest of a record of the current inputs; repeatable",
    )
    options = parser.parse_args(argv)
    chosen = set(options.only or ())
    ids = {entry.id for entry in (*stacks.STACKS, *stacks.UNRESOLVABLE)}
    if chosen - ids:
        parser.error(f"unknown {sorted(chosen - ids)}; the ids: {', '.join(sorted(ids))}")
    inputs = hash_inputs()
    kept = load() if chosen and REPORT.exists() else None
    if chosen and (kept is None or staleness(kept["inputs"])):
        parser.error(f"--only: {REPORT.name} is missing or stale: re-resolve everything")
    outcomes, facts = stacks.run_all(
        [s for s in stacks.STACKS if not chosen or s.id in chosen],
        [u for u in stacks.UNRESOLVABLE if not chosen or u.id in chosen],
        options.jobs,
    )
    if hash_inputs() != inputs:
        print(f"an input changed while pip resolved: {REPORT.name} not written", file=sys.stderr)
        return 2
    report = build(outcomes, facts, inputs)
    if kept:
        report["resolved_on"] = kept["resolved_on"]  # the date of its oldest resolutions
        report["stacks"] = {**kept["stacks"], **report["stacks"]}
        report["unresolvable"] = {**kept["unresolvable"], **report["unresolvable"]}
    REPORT.write_text(dumps(report), encoding="utf-8")
    print(stacks.report(outcomes, facts)[0])
    found = problems(report)
    print("", *found, f"wrote {REPORT.relative_to(stacks.REPO)}", sep="\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
