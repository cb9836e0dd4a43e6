"""A framework page's install block, run verbatim into a test environment.

A framework page (``docs/frameworks/<framework>.md``) marks one bash block
(``<!-- documented-install ...``) as what a user types into the environment where they
run the framework, after the framework's own install. The framework's
``documented_install`` module builds its test environment with it, so the page, the
test environment and the framework's extra cannot drift apart. The only
substitutions: ``pip`` is the target environment's pip, and ``lossreduce[<extra>]``
(not on an index here) is this checkout with the same extra.

Stdlib only: it runs before the environment it builds exists (``python -m``, from the
repository's root).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

__all__ = ["MARKER", "REPO", "DocumentedInstallError", "documented_commands", "localized", "run"]

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- documented-install"


class DocumentedInstallError(ValueError):
    """The page's install block is missing or holds a command this script cannot run as is."""


def documented_commands(page: Path) -> list[list[str]]:
    """The commands of the bash block right after the page's :data:`MARKER`, one per line."""
    text = page.read_text(encoding="utf-8")
    found = re.search(re.escape(MARKER) + r"[^\n]*\n```bash\n(.*?)\n```", text, re.DOTALL)
    if found is None:
        raise DocumentedInstallError(f"{page}: no ```bash block right after {MARKER!r}")
    commands = [shlex.split(line, comments=True) for line in found.group(1).splitlines()]
    return [command for command in commands if command]


def localized(
    command: list[str],
    python: Path,
    *,
    extra: str,
    editable: bool = False,
    constraints: Path | None = None,
) -> list[str]:
    """``command`` run with ``python``'s pip, installing this checkout for
    ``lossreduce[<extra>]``."""
    if command[:2] != ["pip", "install"]:
        raise DocumentedInstallError(
            f"the install block may hold only `pip install` lines, got {shlex.join(command)!r}"
        )
    local = f"{REPO}[{extra}]"
    args: list[str] = []
    for arg in command[2:]:
        if arg == f"lossreduce[{extra}]":
            args += ["-e", local] if editable else [local]
        else:
            args.append(arg)
    if constraints is not None:
        args += ["-c", str(constraints)]
    return [str(python), "-m", "pip", "install", "--quiet", *args]


def run(
    page: Path,
    python: Path,
    *,
    extra: str,
    editable: bool = False,
    constraints: Path | None = None,
) -> None:
    """Every command of ``page``'s install block, into the environment of ``python``."""
    commands = documented_commands(page)
    if not any(f"lossreduce[{extra}]" in command for command in commands):
        raise DocumentedInstallError(
            f"{page.name}: the install block never installs lossreduce[{extra}]"
        )
    for command in commands:
        subprocess.run(
            localized(command, python, extra=extra, editable=editable, constraints=constraints),
            check=True,
        )
