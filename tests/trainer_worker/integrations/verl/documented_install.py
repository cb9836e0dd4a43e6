"""The install of docs/frameworks/verl.md, run verbatim into a verl user's Python environment.

``make test-verl`` builds ``.venv-verl`` with the page's install block
(:mod:`tests.documented_install`) and ``test_documented_install.py`` builds a fresh
environment with it, so the page, the test environment and the ``verl`` extra cannot
drift apart.

``--constraints FILE`` (``constraints/verl.txt``: the versions pip's resolver picks
for ``verl[vllm]==0.9.1``) first builds the user's environment the page starts from:
verl's ``vllm`` extra without vllm itself (:data:`VERL_ENVIRONMENT`: a GPU engine the
CPU tests never import), at exactly those versions; then every documented command runs
with the same constraints. A documented command that would change one of verl's
versions (torch, protobuf, transformers, ray, ...) then fails to resolve rather than
replacing it.

Stdlib only: it runs before the environment it builds exists (``python -m``, from the
repository's root; the page's block is read and run by :mod:`tests.documented_install`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tests import documented_install as block

__all__ = [
    "CONSTRAINTS",
    "DOCS_PAGE",
    "MEGATRON_ENVIRONMENT",
    "VERL_ENVIRONMENT",
    "documented_commands",
    "install",
    "install_verl_environment",
]

DOCS_PAGE = block.REPO / "docs" / "frameworks" / "verl.md"
CONSTRAINTS = block.REPO / "constraints" / "verl.txt"

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


def documented_commands(page: Path = DOCS_PAGE) -> list[list[str]]:
    """The commands of the page's install block, one per line."""
    return block.documented_commands(page)


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
    block.documented_commands(DOCS_PAGE)  # the block exists before anything installs
    if constraints is not None:
        install_verl_environment(python, constraints, environment)
    block.run(DOCS_PAGE, python, extra="verl", editable=editable, constraints=constraints)


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
