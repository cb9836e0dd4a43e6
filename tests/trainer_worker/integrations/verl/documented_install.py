"""The install of docs/frameworks/verl.md, run verbatim into a verl user's Python environment.

The page marks one bash block (``<!-- documented-install ...``) as what a verl user
types into the environment where they run verl, after verl's own install. ``make
test-verl`` builds ``.venv-verl`` with it and ``test_documented_install.py`` builds a
fresh environment with it, so the page, the test environment and the ``verl`` extra
cannot drift apart. The only substitutions: ``pip`` is the target environment's pip,
and ``lossreduce[verl]`` (not on an index here) is this checkout with the same extra.

``--constraints FILE`` (``constraints/verl.txt``: the versions pip's resolver picks
for ``verl[vllm]==0.9.1``) first builds the user's environment the page starts from:
verl's ``vllm`` extra without vllm itself (:data:`VERL_ENVIRONMENT`: a GPU engine the
CPU tests never import), at exactly those versions; then every documented command runs
with the same constraints. A documented command that would change one of verl's
versions (torch, protobuf, transformers, ray, ...) then fails to resolve rather than
replacing it.

Stdlib only: it runs before the environment it builds exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = [
    "CONSTRAINTS",
    "DOCS_PAGE",
    "MARKER",
    "MEGATRON_ENVIRONMENT",
    "VERL_ENVIRONMENT",
    "documented_commands",
    "install",
    "install_verl_environment",
    "localized",
]

REPO = Path(__file__).resolve().parents[4]
DOCS_PAGE = REPO / "docs" / "frameworks" / "verl.md"
CONSTRAINTS = REPO / "constraints" / "verl.txt"
MARKER = "<!-- documented-install"
PACKAGE = "lossreduce[verl]"

VERL_ENVIRONMENT = (
    "verl[verl-core]",
    "torch",
    "torchvision",
    "torchaudio",
    "transformers",
    "mbridge",
)
"""verl 0.9.1's ``vllm`` extra less ``vllm``: ``verl[verl-core]`` and the pins the extra
adds (torch 2.11.0, torchvision 0.26.0, torchaudio 2.11.0, transformers 5.9.0) plus
mbridge; the versions come from the constraints file."""

MEGATRON_ENVIRONMENT = (*VERL_ENVIRONMENT, "mbridge[megatron]")
"""A verl Megatron user's environment without its GPU parts: :data:`VERL_ENVIRONMENT`
(whose mbridge is verl's ``mcore`` extra) and Megatron-Core, which no verl extra that
resolves brings (``verl[megatron]==0.9.1`` pins megatron-bridge 0.5.2, which the index
does not have). Transformer Engine and vllm, CUDA builds, are left out."""


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


def localized(
    command: list[str],
    python: Path,
    editable: bool = False,
    constraints: Path | None = None,
) -> list[str]:
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
    if constraints is not None:
        args += ["-c", str(constraints)]
    return [str(python), "-m", "pip", "install", "--quiet", *args]


def install_verl_environment(
    python: Path, constraints: Path = CONSTRAINTS, environment: tuple[str, ...] = VERL_ENVIRONMENT
) -> None:
    """The environment a ``verl[vllm]==0.9.1`` user has, without vllm: the page's start
    (``environment``: :data:`MEGATRON_ENVIRONMENT` for verl's Megatron engine)."""
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints), *environment],
        check=True,
    )


def install(
    python: Path,
    editable: bool = False,
    constraints: Path | None = None,
    environment: tuple[str, ...] = VERL_ENVIRONMENT,
) -> None:
    """Run every documented command into the environment of ``python``.

    With ``constraints``, the verl environment the page starts from (``environment``)
    is installed first (:func:`install_verl_environment`) and every command runs under
    the same pins.
    """
    commands = documented_commands()
    if not any(PACKAGE in command for command in commands):
        raise DocumentedInstallError(
            f"{DOCS_PAGE.name}: the install block never installs {PACKAGE!r}"
        )
    if constraints is not None:
        install_verl_environment(python, constraints, environment)
    for command in commands:
        subprocess.run(localized(command, python, editable, constraints), check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python", type=Path, required=True, help="the target environment's python"
    )
    parser.add_argument(
        "--editable", action="store_true", help="install this checkout editable (the dev venv)"
    )
    parser.add_argument(
        "--constraints",
        type=Path,
        help="the verl[vllm] resolution's versions: install verl's environment from them "
        "first, then the documented commands under the same pins",
    )
    parser.add_argument(
        "--megatron",
        action="store_true",
        help="start from a verl Megatron user's environment (megatron-core added)",
    )
    options = parser.parse_args(argv)
    environment = MEGATRON_ENVIRONMENT if options.megatron else VERL_ENVIRONMENT
    install(options.python, options.editable, options.constraints, environment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
