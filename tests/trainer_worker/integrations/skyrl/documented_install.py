"""The install of docs/frameworks/skyrl.md, run verbatim into a SkyRL user's environment.

``make test-skyrl`` builds ``.venv-skyrl`` with the page's install block
(:mod:`tests.documented_install`), so the page, the test environment and the ``skyrl``
extra cannot drift apart.

``--constraints FILE`` (``constraints/skyrl.txt``: the versions pip's resolver picks for
``skyrl[fsdp]==0.4.0`` on Python 3.12) first builds the SkyRL environment the page starts
from, as close to ``skyrl[fsdp]==0.4.0`` as a machine without CUDA and with PyPI only
allows (:func:`install_skyrl_environment`; the page says what differs), at exactly
those versions; then every documented command runs with the same constraints. A
documented command that would change one of SkyRL's versions (torch, transformers, ray,
vllm, ...) then fails to resolve rather than replacing it.

Stdlib only: it runs before the environment it builds exists (``python -m``, from the
repository's root).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from tests import documented_install as block

__all__ = [
    "BUILD_TOOLS",
    "BUILT_WITHOUT_KERNELS",
    "CONSTRAINTS",
    "DOCS_PAGE",
    "SKYRL_ENVIRONMENT",
    "install",
    "install_skyrl_environment",
]

DOCS_PAGE = block.REPO / "docs" / "frameworks" / "skyrl.md"
CONSTRAINTS = block.REPO / "constraints" / "skyrl.txt"

BUILD_TOOLS = ("torch", "setuptools", "wheel", "packaging", "psutil", "ninja")
"""What the two source builds below import at build time, installed first: torch (the
2.13.0 that ``skyrl[fsdp]`` pins), as flash-attn's own install instructions ask."""
BUILT_WITHOUT_KERNELS = {
    "flash-attn": "FLASH_ATTENTION",
    "causal-conv1d": "CAUSAL_CONV1D",
}
"""``skyrl[fsdp]``'s two source distributions (no wheel on PyPI), built against the
installed torch (``--no-build-isolation``) with ``<PREFIX>_SKIP_CUDA_BUILD=TRUE``: their
Python code without their CUDA kernels, which need nvcc (``<PREFIX>_FORCE_BUILD=TRUE``
skips their download of a prebuilt wheel from GitHub)."""
SKYRL_ENVIRONMENT = (
    "skyrl[skyrl-train]",
    "vllm",
    "vllm-router",
    "nixl",
    "flash-linear-attention",
    "torch",
    "torchvision",
    "flashinfer-python",
)
"""``skyrl[fsdp]==0.4.0`` spelled out, less what PyPI does not have: its ``skyrl-train``
extra and every package the ``fsdp`` extra adds, but ``flashinfer-jit-cache`` and
``flashinfer-cubin`` 0.6.18.post1 (published on FlashInfer's own index only) and the two
source builds above (installed first); the versions come from the constraints file."""


def _pip(python: Path, constraints: Path, *args: str, env: dict[str, str] | None = None) -> None:
    command = [str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints), *args]
    subprocess.run(command, check=True, env=env)


def install_skyrl_environment(python: Path, constraints: Path = CONSTRAINTS) -> None:
    """The environment a ``skyrl[fsdp]==0.4.0`` user has, as close as PyPI and a machine
    without CUDA allow: the page's start."""
    _pip(python, constraints, *BUILD_TOOLS)
    env = dict(os.environ)
    for prefix in BUILT_WITHOUT_KERNELS.values():
        env[f"{prefix}_SKIP_CUDA_BUILD"] = "TRUE"
        env[f"{prefix}_FORCE_BUILD"] = "TRUE"
    _pip(python, constraints, "--no-build-isolation", *BUILT_WITHOUT_KERNELS, env=env)
    _pip(python, constraints, *SKYRL_ENVIRONMENT)


def install(python: Path, editable: bool = False, constraints: Path | None = None) -> None:
    """Run every documented command into the environment of ``python``.

    With ``constraints``, the SkyRL environment the page starts from is installed first
    (:func:`install_skyrl_environment`) and every command runs under the same pins.
    """
    block.documented_commands(DOCS_PAGE)  # the block exists before anything installs
    if constraints is not None:
        install_skyrl_environment(python, constraints)
    block.run(DOCS_PAGE, python, extra="skyrl", editable=editable, constraints=constraints)


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
        help="the skyrl[fsdp] resolution's versions: install SkyRL's environment from them "
        "first, then the documented commands under the same pins",
    )
    options = parser.parse_args(argv)
    install(options.python, options.editable, options.constraints)
    return 0


if __name__ == "__main__":
    sys.exit(main())
