"""The install of docs/frameworks/verl.md, run verbatim into a Python environment.

The page marks one bash block (``<!-- documented-install ...``) as the install a verl
user types. ``make test-verl`` builds ``.venv-verl`` with it and
``test_documented_install.py`` builds a fresh environment with it, so the page, the
test environment and the ``verl`` extra cannot drift apart. The only substitutions:
``pip`` is the target environment's pip, and ``lossreduce[verl]`` (not on an index
here) is this checkout with the same extra.

Stdlib only: it runs before the environment it builds exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["DOCS_PAGE", "MARKER", "documented_commands", "install", "localized"]

REPO = Path(__file__).resolve().parents[4]
DOCS_PAGE = REPO / "docs" / "frameworks" / "verl.md"
MARKER = "<!-- documented-install"
PACKAGE = "lossreduce[verl]"


class DocumentedInstallError(ValueError):
    """The page's install block is missing or holds a command this script cannot run as is."""


def documented_commands(page: Path = DOCS_PAGE) -> list[list[str]]:
    """The commands of the bash block right after the page's :data:`MARKER`, one per line."""
    text = page.read_text(encoding="utf-8")
    found = re.search(re.escape(MARKER) + r"[^\n]*\n```bash\n(.*?)\n```", text, re.DOTALL)
    if found is None:
        raise DocumentedInstallError(f"{page}: no ```bash block right after {MARKER!r}")
    commands = [shlex.split(line, comments=True) for line in found.group(1).splitlines()]
    return [command for command in commands if command]


def localized(command: list[str], python: Path, editable: bool = False) -> list[str]:
    """``command`` run with ``python``'s pip, installing this checkout for ``lossreduce[verl]``."""
    if command[:2] != ["pip", "install"]:
        raise DocumentedInstallError(
            f"{DOCS_PAGE.name}: the install block may hold only `pip install` lines, "
            f"got {shlex.join(command)!r}"
        )
    local = f"{REPO}[verl]"
    args: list[str] = []
    for arg in command[2:]:
        if arg == PACKAGE:
            args += ["-e", local] if editable else [local]
        else:
            args.append(arg)
    return [str(python), "-m", "pip", "install", "--quiet", *args]


def install(python: Path, editable: bool = False) -> None:
    """Run every documented command into the environment of ``python``."""
    commands = documented_commands()
    if not any(PACKAGE in command for command in commands):
        raise DocumentedInstallError(
            f"{DOCS_PAGE.name}: the install block never installs {PACKAGE!r}"
        )
    for command in commands:
        subprocess.run(localized(command, python, editable), check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python", type=Path, required=True, help="the target environment's python"
    )
    parser.add_argument(
        "--editable", action="store_true", help="install this checkout editable (the dev venv)"
    )
    options = parser.parse_args(argv)
    install(options.python, options.editable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
