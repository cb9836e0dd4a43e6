"""Does lossreduce install into a framework's environment without changing it? pip decides.

A user of verl, vLLM, SGLang, AReaL, TRL or SkyRL already has an environment their
framework's install built: its torch, protobuf, transformers, inference engine and Ray
were picked by pip for that framework. lossreduce declares ranges (pyproject.toml) so
that it fits into that environment rather than the other way round. This module checks
that with pip's own resolver, without installing anything: for each stack of
:data:`STACKS` it resolves the framework's install alone, then the same install plus
this checkout with the framework's extra (``lossreduce[verl] @ file:///...``), and
compares the two: adding lossreduce must change none of :data:`WATCHED` (any other
version that moved is reported too). :data:`UNRESOLVABLE` records installs that pip
cannot resolve even without lossreduce, with pip's one-line reason.

How it resolves: ``pip install --dry-run --ignore-installed --report FILE
--use-feature=fast-deps SPEC...`` in a venv of the stack's Python (created once under
``build/resolve/``, its pip upgraded), which reads only the wheels' metadata. The
machine's pip configuration (a local wheel folder, a constraints file) is left out
(``PIP_CONFIG_FILE=/dev/null``, no ``PIP_FIND_LINKS``/``PIP_CONSTRAINT``), so pip resolves
against the index as a user's pip does. The resolutions are mostly waiting on the
network: ``--jobs`` (default 2) of them run at a time.

Stdlib only: it runs from any Python 3.10+ (``python tests/install/stacks.py``), and
``tests/install/test_resolution.py`` runs it under pytest (``make test-resolve``). What it
found is committed in ``tests/install/resolutions.json`` with a hash of its inputs (this
file among them), which the main test run checks without the network; rewrite it with
``python -m tests.install.resolution_report`` (``tests/install/resolution_report.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "REPO",
    "STACKS",
    "UNRESOLVABLE",
    "WATCHED",
    "Failure",
    "Outcome",
    "Resolution",
    "ResolutionError",
    "Stack",
    "Unresolvable",
    "canonical",
    "ensure_venv",
    "find_python",
    "lossreduce_spec",
    "main",
    "pip_environment",
    "pip_reason",
    "report",
    "resolve",
    "run_all",
]

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "resolve"
"""Venvs (``venv-3.11``, ...) and pip's logs (``logs/``) of the resolutions."""

WATCHED = ("torch", "protobuf", "transformers", "vllm", "sglang", "ray")
"""The versions of the stack that adding lossreduce must leave as they are."""

PIP_TIMEOUT_S = 1200
"""One resolution's limit (they take 25-130 s on a 2-core machine)."""


@dataclass(frozen=True)
class _Install:
    """A framework's install (``specs``) on ``python``."""

    name: str
    python: str
    specs: tuple[str, ...]
    prepare: tuple[str, ...] = field(default=(), kw_only=True)
    """Installed into the resolving venv first, for an install whose source builds import
    them (flash-attn's ``setup.py`` imports torch): the resolution then runs with
    ``--no-build-isolation``, as those packages' own instructions say."""
    build_env: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)
    """Environment variables of those source builds (``FLASH_ATTENTION_SKIP_CUDA_BUILD``)."""

    @property
    def id(self) -> str:
        return f"{self.name}@{self.python}"


@dataclass(frozen=True)
class Stack(_Install):
    """A framework's install, resolved alone and with ``lossreduce[extra]`` on ``python``."""

    extra: str


@dataclass(frozen=True)
class Unresolvable(_Install):
    """A framework's install that pip cannot resolve even alone; ``expect`` is in pip's reason."""

    expect: str


SKYRL_FSDP = (
    "skyrl[skyrl-train]==0.4.0",
    "vllm==0.30.0",
    "vllm-router",
    "nixl",
    "flash-linear-attention",
    "causal-conv1d==1.6.2.post1",
    "flash-attn==2.8.3",
    "torch==2.13.0",
    "flashinfer-python==0.6.18.post1",
    "torchvision",
)
"""``skyrl[fsdp]==0.4.0`` spelled out (its ``skyrl-train`` extra and what its ``fsdp``
extra adds, from the wheel's metadata), less ``flashinfer-jit-cache`` and
``flashinfer-cubin`` 0.6.18.post1, which are on FlashInfer's own index, not on PyPI."""
SKYRL_BUILD = ("torch==2.13.0", "setuptools", "wheel", "packaging", "psutil", "ninja")
"""What flash-attn's and causal-conv1d's ``setup.py`` import, installed first: torch is
the one ``skyrl[fsdp]`` pins."""
SKYRL_BUILD_ENV = (
    ("FLASH_ATTENTION_SKIP_CUDA_BUILD", "TRUE"),
    ("CAUSAL_CONV1D_SKIP_CUDA_BUILD", "TRUE"),
)
"""Their metadata without nvcc (the variables their ``setup.py`` reads; the metadata does
not depend on them)."""

STACKS: tuple[Stack, ...] = (
    Stack("verl[vllm]", "3.11", ("verl[vllm]==0.9.1",), "verl"),
    Stack("verl[vllm]", "3.12", ("verl[vllm]==0.9.1",), "verl"),
    Stack("vllm", "3.11", ("vllm==0.33.0",), "trainer"),
    Stack("sglang", "3.11", ("sglang==0.5.23",), "trainer"),
    Stack("areal", "3.11", ("areal==1.0.4",), "areal"),
    Stack("trl[vllm]", "3.11", ("trl[vllm]==1.16.0",), "trl"),
    Stack("skyrl", "3.12", ("skyrl==0.4.0",), "trainer"),
    Stack(
        "skyrl[fsdp]", "3.12", SKYRL_FSDP, "skyrl", prepare=SKYRL_BUILD, build_env=SKYRL_BUILD_ENV
    ),
)
"""Every framework environment lossreduce must install into unchanged: the one table."""

UNRESOLVABLE: tuple[Unresolvable, ...] = (
    # verl pins transformers==5.9.0 for its sglang extra; the sglang it allows pins another.
    Unresolvable("verl[sglang]", "3.11", ("verl[sglang]==0.9.1",), "ResolutionImpossible"),
    # openrlhf pins flash-attn, an sdist whose setup.py imports torch before pip knows it.
    Unresolvable("openrlhf", "3.11", ("openrlhf==0.11.2",), "No module named 'torch'"),
    # Two of skyrl[fsdp]'s pins are published on FlashInfer's index only (with torch
    # installed first, so that flash-attn's metadata builds, pip gets that far).
    Unresolvable(
        "skyrl[fsdp]",
        "3.12",
        ("skyrl[fsdp]==0.4.0",),
        "No matching distribution found for flashinfer-jit-cache==0.6.18.post1",
        prepare=SKYRL_BUILD,
        build_env=SKYRL_BUILD_ENV,
    ),
)
"""Installs that fail without lossreduce: recorded, with pip's reason, not held against it."""


class ResolutionError(RuntimeError):
    """pip could not resolve a spec list: names what was resolved, on which Python, and why."""

    def __init__(self, label: str, python: str, returncode: int, output: str, log: Path) -> None:
        self.label = label
        self.python = python
        self.returncode = returncode
        self.output = output
        self.reason = pip_reason(output)
        tail = "\n".join(output.rstrip().splitlines()[-15:])
        super().__init__(
            f"{label} on Python {python}: pip exited {returncode}: {self.reason}\n"
            f"pip's last lines (all of them in {log}):\n{tail}"
        )


@dataclass(frozen=True)
class Resolution:
    """What pip would install for one spec list: ``versions`` maps canonical names."""

    versions: dict[str, str]
    seconds: float


@dataclass(frozen=True)
class Failure:
    """A resolution pip refused: its one-line reason and the error with pip's last lines."""

    error: ResolutionError
    seconds: float


@dataclass
class Outcome:
    """A stack's two resolutions and what adding lossreduce changed."""

    stack: Stack
    alone: Resolution | Failure
    together: Resolution | Failure
    watched_changes: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Watched packages of the stack whose version adding lossreduce changed (or removed)."""
    other_changes: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Any other package of the stack whose version adding lossreduce changed (or removed)."""
    watched_added: dict[str, str] = field(default_factory=dict)
    """Watched packages the stack lacks and lossreduce brings (``ray`` for ``[trainer]``)."""

    def __post_init__(self) -> None:
        if isinstance(self.alone, Resolution) and isinstance(self.together, Resolution):
            before, after = self.alone.versions, self.together.versions
            for name, version in after.items():
                if name in WATCHED and name not in before:
                    self.watched_added[name] = version
            for name, old in sorted(before.items()):
                new = after.get(name)
                if new != old:
                    target = self.watched_changes if name in WATCHED else self.other_changes
                    target[name] = (old, new)

    @property
    def pulled_in(self) -> bool:
        """Whether the resolution with the extra installs lossreduce itself."""
        return isinstance(self.together, Resolution) and "lossreduce" in self.together.versions

    @property
    def ok(self) -> bool:
        return (
            isinstance(self.alone, Resolution)
            and isinstance(self.together, Resolution)
            and self.pulled_in
            and not self.watched_changes
        )

    @property
    def verdict(self) -> str:
        if isinstance(self.alone, Failure):
            return f"ERROR alone: {self.alone.error.reason}"
        if isinstance(self.together, Failure):
            return f"ERROR with lossreduce: {self.together.error.reason}"
        if not self.pulled_in:
            return "ERROR: the resolution with the extra does not install lossreduce"
        if self.watched_changes:
            return "CHANGED " + ", ".join(
                f"{name} {old} -> {new or 'removed'}"
                for name, (old, new) in self.watched_changes.items()
            )
        if self.other_changes:
            return f"unchanged; {len(self.other_changes)} other moved (below)"
        return "unchanged"


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares it (``Flask_SQL.x`` -> ``flask-sql-x``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lossreduce_spec(extra: str) -> str:
    """This checkout with ``extra``, as pip takes it (lossreduce is on no index)."""
    return f"lossreduce[{extra}] @ {REPO.as_uri()}"


def pip_environment() -> dict[str, str]:
    """The environment pip runs in: the machine's pip configuration left out."""
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = os.devnull
    for name in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(name, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def find_python(version: str) -> Path:
    """An interpreter of ``version`` (``"3.12"``): ``$LOSSREDUCE_PYTHON_3_12``, pyenv's, or PATH's."""
    override = os.environ.get(f"LOSSREDUCE_PYTHON_{version.replace('.', '_')}")
    if override:
        return Path(override)
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(
        pyenv.glob(f"{version}.*/bin/python{version}"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parents[1].name)],
    )
    if found:
        return found[-1]
    on_path = shutil.which(f"python{version}")
    if on_path:
        return Path(on_path)
    raise FileNotFoundError(
        f"no Python {version}: not in {pyenv}, not python{version} on PATH; "
        f"set LOSSREDUCE_PYTHON_{version.replace('.', '_')} to one"
    )


def ensure_venv(version: str, prepare: Sequence[str] = ()) -> Path:
    """The pip of ``build/resolve/venv-VERSION`` (``venv-VERSION-<hash>`` with ``prepare``
    installed in it), created (pip upgraded) on first use."""
    suffix = f"-{hashlib.sha256(' '.join(prepare).encode()).hexdigest()[:8]}" if prepare else ""
    venv = WORK / f"venv-{version}{suffix}"
    pip = venv / "bin" / "pip"
    ready = venv / ".prepared"
    if ready.exists():
        return pip
    shutil.rmtree(venv, ignore_errors=True)
    python = find_python(version)
    steps = [
        [str(python), "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
    ]
    if prepare:
        steps.append([str(pip), "install", "--quiet", *prepare])
    for command in steps:
        done = subprocess.run(
            command, env=pip_environment(), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(
                f"creating the Python {version} venv failed: {' '.join(command)}\n"
                f"{(done.stdout + done.stderr).rstrip()[-2000:]}"
            )
    ready.touch()
    return pip


def pip_reason(output: str) -> str:
    """pip's reason for a failed resolution, in one line.

    A conflict: ``ResolutionImpossible:`` and pip's "The conflict is caused by" lines. A
    failed build: pip's last ``ERROR:`` line and the last exception of the build's output.
    """
    lines = output.splitlines()
    if "The conflict is caused by:" in lines:
        start = lines.index("The conflict is caused by:") + 1
        causes: list[str] = []
        for line in lines[start:]:
            if not line.strip():
                break
            causes.append(line.strip())
        return "ResolutionImpossible: " + "; ".join(causes)
    errors = [line.removeprefix("ERROR: ").strip() for line in lines if line.startswith("ERROR:")]
    exceptions = [
        line.strip()
        for line in lines
        if re.match(r"\s*(\w+\.)*\w*(Error|Exception): ", line) and not line.startswith("ERROR:")
    ]
    reason = errors[-1] if errors else (lines[-1].strip() if lines else "no output")
    if exceptions:
        reason += f" ({exceptions[-1]})"
    return reason


def resolve(
    specs: Sequence[str],
    python: str,
    label: str | None = None,
    *,
    prepare: Sequence[str] = (),
    build_env: Sequence[tuple[str, str]] = (),
) -> Resolution:
    """What pip on Python ``python`` would install for ``specs``: {canonical name: version}.

    Read from pip's ``--report`` JSON; nothing is installed. Raises
    :class:`ResolutionError` (``label``, the Python, pip's reason and last lines) when
    pip fails. pip's output is kept in ``build/resolve/logs/LABEL.log``.
    """
    label = label or " ".join(specs)
    pip = ensure_venv(python, prepare)
    isolation = ["--no-build-isolation"] if prepare else []
    env = {**pip_environment(), **dict(build_env)}
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / (re.sub(r"[^][\w.@+-]+", "_", label) + ".log")
    with tempfile.TemporaryDirectory(prefix="resolve-") as tmp:
        report = Path(tmp) / "report.json"
        command = [
            str(pip), "install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps",
            *isolation, "--report", str(report), *specs,
        ]  # fmt: skip
        start = time.monotonic()
        try:
            done = subprocess.run(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=PIP_TIMEOUT_S,
                check=False,
            )
            output, returncode = done.stdout, done.returncode
        except subprocess.TimeoutExpired as expired:
            out = expired.stdout
            output = (out.decode() if isinstance(out, bytes) else out or "") + (
                f"\nERROR: no answer from pip in {PIP_TIMEOUT_S} s"
            )
            returncode = -1
        seconds = time.monotonic() - start
        log.write_text(f"$ {' '.join(command)}\n{output}", encoding="utf-8")
        if returncode != 0 or not report.exists():
            raise ResolutionError(label, python, returncode, output, log)
        data = json.loads(report.read_text(encoding="utf-8"))
    versions = {
        canonical(item["metadata"]["name"]): str(item["metadata"]["version"])
        for item in data["install"]
    }
    return Resolution(versions, seconds)


def _attempt(entry: _Install, specs: Sequence[str], label: str) -> Resolution | Failure:
    start = time.monotonic()
    try:
        return resolve(specs, entry.python, label, prepare=entry.prepare, build_env=entry.build_env)
    except ResolutionError as error:
        return Failure(error, time.monotonic() - start)


def run_all(
    stacks: Iterable[Stack] = STACKS,
    unresolvable: Iterable[Unresolvable] = UNRESOLVABLE,
    jobs: int = 2,
) -> tuple[list[Outcome], list[tuple[Unresolvable, Resolution | Failure]]]:
    """Every resolution of ``stacks`` (alone, with lossreduce) and of ``unresolvable``,
    ``jobs`` at a time; the venvs are made first, one per Python."""
    stacks, unresolvable = list(stacks), list(unresolvable)
    for version, prepare in sorted(
        {(s.python, s.prepare) for s in stacks} | {(u.python, u.prepare) for u in unresolvable}
    ):
        ensure_venv(version, prepare)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pairs = [
            (
                stack,
                pool.submit(_attempt, stack, stack.specs, f"{stack.id} alone"),
                pool.submit(
                    _attempt,
                    stack,
                    (*stack.specs, lossreduce_spec(stack.extra)),
                    f"{stack.id} + lossreduce[{stack.extra}]",
                ),
            )
            for stack in stacks
        ]
        facts = [(u, pool.submit(_attempt, u, u.specs, f"{u.id} alone")) for u in unresolvable]
        outcomes = [Outcome(stack, alone.result(), both.result()) for stack, alone, both in pairs]
        return outcomes, [(u, future.result()) for u, future in facts]


def _version(outcome: Outcome, name: str) -> str:
    if name in outcome.watched_changes:
        old, new = outcome.watched_changes[name]
        return f"{old} -> {new or 'removed'}"
    if name in outcome.watched_added:
        return f"(+{outcome.watched_added[name]})"
    for result in (outcome.together, outcome.alone):
        if isinstance(result, Resolution):
            return result.versions.get(name, "-")
    return "?"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def report(
    outcomes: list[Outcome], facts: list[tuple[Unresolvable, Resolution | Failure]]
) -> tuple[str, bool]:
    """The printed table and whether every stack and every fact came out as expected."""
    rows = [["stack", "Python", "alone s", "with s", *WATCHED, "verdict"]]
    notes: list[str] = []
    for o in outcomes:
        rows.append(
            [
                f"{o.stack.name} + lossreduce[{o.stack.extra}]",
                o.stack.python,
                f"{o.alone.seconds:.0f}",
                f"{o.together.seconds:.0f}",
                *(_version(o, name) for name in WATCHED),
                o.verdict,
            ]
        )
        if o.other_changes:
            changed = ", ".join(
                f"{name} {old} -> {new or 'removed'}"
                for name, (old, new) in o.other_changes.items()
            )
            notes.append(f"{o.stack.id}: other versions changed by lossreduce: {changed}")
        if o.watched_added:
            added = ", ".join(f"{name} {v}" for name, v in o.watched_added.items())
            notes.append(f"{o.stack.id}: not in the stack, brought by lossreduce: {added}")
        for result in (o.alone, o.together):
            if isinstance(result, Failure):
                notes.append(str(result.error))
    ok = all(o.ok for o in outcomes)
    fact_rows = [["does not resolve alone", "Python", "alone s", "as expected", "pip's reason"]]
    for u, result in facts:
        if isinstance(result, Failure):
            expected = u.expect in result.error.output
            fact_rows.append(
                [u.specs[0], u.python, f"{result.seconds:.0f}", "yes" if expected else "NO",
                 result.error.reason]
            )  # fmt: skip
        else:
            expected = False
            fact_rows.append(
                [u.specs[0], u.python, f"{result.seconds:.0f}", "NO", "it resolves now"]
            )
        ok = ok and expected
    parts = [_table(rows)] if outcomes else []
    if facts:
        parts.append(_table(fact_rows))
    parts += notes
    return "\n\n".join(parts), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs", type=int, default=2, help="resolutions at a time (default 2: network-bound)"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="only this stack: its name (verl[vllm]) or NAME@PYTHON (verl[vllm]@3.12); repeatable",
    )
    options = parser.parse_args(argv)
    chosen = set(options.only or ())
    stacks = [s for s in STACKS if not chosen or s.name in chosen or s.id in chosen]
    facts = [u for u in UNRESOLVABLE if not chosen or u.name in chosen or u.id in chosen]
    if not stacks and not facts:
        names = sorted({s.id for s in STACKS} | {u.id for u in UNRESOLVABLE})
        parser.error(f"no stack named {sorted(chosen)}; the stacks: {', '.join(names)}")
    start = time.monotonic()
    outcomes, results = run_all(stacks, facts, options.jobs)
    text, ok = report(outcomes, results)
    print(text)
    print(f"\nwall time {time.monotonic() - start:.0f} s, {options.jobs} at a time")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
