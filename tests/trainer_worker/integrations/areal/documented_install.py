"""Install the AReaL integration with exactly the commands docs/frameworks/areal.md gives.

The page's install commands sit in one ``bash`` block between the markers
``<!-- areal-install:begin -->`` and ``<!-- areal-install:end -->``. This
script reads them and runs each with a given interpreter's pip, so that
``make test-areal``'s environment and ``test_documented_install.py``'s fresh
one are built by what a user reads, and cannot drift from it. The page
installs AReaL with its own dependencies, then lossreduce into that
environment. Two things change, both stated here:

- ``lossreduce[areal]`` names this checkout (``<root>[areal]``, editable with
  ``--editable``): the package under test, not the one on the index;
- ``--constraints FILE`` pins every package of every command to the versions
  tested (``constraints/areal.txt``: AReaL's own resolution, then what
  lossreduce adds to it), so CI does not move when the index does.

Usage: ``python documented_install.py --python VENV/bin/python
[--constraints FILE] [--editable] [--print]``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
PAGE = ROOT / "docs" / "frameworks" / "areal.md"
BEGIN = "<!-- areal-install:begin -->"
END = "<!-- areal-install:end -->"
PACKAGE = "lossreduce[areal]"


def documented_commands(page: Path = PAGE) -> list[str]:
    """The shell commands of the page's marked install block, one per line."""
    text = page.read_text()
    match = re.search(re.escape(BEGIN) + r"\s*```bash\n(.*?)```\s*" + re.escape(END), text, re.S)
    if match is None:
        raise SystemExit(f"{page}: no ```bash block between {BEGIN} and {END}")
    commands = [line.strip() for line in match.group(1).splitlines() if line.strip()]
    for command in commands:
        if not command.startswith("pip install "):
            raise SystemExit(f"{page}: the install block holds {command!r}, not a pip install")
    return commands


def pip_arguments(command: str, constraints: Path | None, editable: bool) -> list[str]:
    """``command`` (``pip install ...``) as arguments for ``python -m pip``."""
    words = shlex.split(command)[2:]
    out = ["install"]
    for word in words:
        if word == PACKAGE:
            local = f"{ROOT}[areal]"
            out += ["-e", local] if editable else [local]
        else:
            out.append(word)
    if constraints is not None:
        out += ["-c", str(constraints)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the interpreter whose pip installs")
    parser.add_argument("--constraints", type=Path, help="pin file for the dependencies")
    parser.add_argument("--editable", action="store_true", help="install this checkout editable")
    parser.add_argument("--print", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    for command in documented_commands():
        pip = [
            args.python,
            "-m",
            "pip",
            "--quiet",
            *pip_arguments(command, args.constraints, args.editable),
        ]
        print(f"# {command}\n{shlex.join(pip)}", flush=True)
        if not args.print:
            subprocess.run(pip, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
