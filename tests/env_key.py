"""The key of a test environment: a hash of everything its build reads.

``make`` keeps each framework's and each matrix cell's environment outside the clone
(``$(ENV_ROOT)/<name>.<key>``, envs.mk) and builds it again only when its key changes:
a new clone of the same commit, or a commit that changed none of the build's inputs,
finds it built. The inputs are the build's recipes (``envs.mk``), ``pyproject.toml``,
the environment's constraints, the scripts its build runs, the interpreter's version and,
of ``pyproject.toml`` and a framework page, only what the build reads: the install's
tables, and the page's install block (the rest may change freely).

Stdlib only: ``make`` runs it before any environment exists
(``python3 -m tests.env_key verl python3.11``, from the repository's root, prints
the key).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
VERL_SCRIPTS = (
    "tests/documented_install.py",
    "tests/trainer_worker/integrations/verl/documented_install.py",
)
SKYRL_SCRIPTS = (
    "tests/documented_install.py",
    "tests/trainer_worker/integrations/skyrl/documented_install.py",
)

INPUTS: dict[str, tuple[str, ...]] = {
    "verl": ("constraints/verl.txt", *VERL_SCRIPTS, "docs/frameworks/verl.md"),
    "verl-megatron": ("constraints/verl-megatron.txt", *VERL_SCRIPTS, "docs/frameworks/verl.md"),
    "areal": (
        "constraints/areal.txt",
        "tests/trainer_worker/integrations/areal/documented_install.py",
        "docs/frameworks/areal.md",
    ),
    "megatron": ("constraints/megatron.txt",),
    "skyrl": ("constraints/skyrl.txt", *SKYRL_SCRIPTS, "docs/frameworks/skyrl.md"),
    "floor": ("constraints/floor.txt",),
    "ceiling": ("constraints/ceiling.txt",),
}
"""Each environment's own inputs; every key also reads :data:`COMMON`."""

COMMON = ("envs.mk", "pyproject.toml")

INSTALLED_TABLES = ("build-system", "project", "tool.setuptools")
"""What an install reads of pyproject.toml: its dependencies, extras, entry points and
package layout; the test, lint and type-check settings may change without a rebuild."""

INSTALL_BLOCK = re.compile(
    r"<!-- (?:documented-install|[a-z]+-install:begin)[^\n]*\n\s*```bash\n(.*?)```", re.S
)
"""A framework page's install block (the only part of the page a build reads)."""


def installed_tables(pyproject: bytes) -> bytes:
    """What an install reads of ``pyproject``'s text (:data:`INSTALLED_TABLES`), as
    canonical JSON: hashing it ignores edits to the test and lint settings."""
    data = tomllib.loads(pyproject.decode("utf-8"))
    kept: dict[str, object] = {}
    for dotted in INSTALLED_TABLES:
        value: object = data
        for part in dotted.split("."):
            value = value.get(part, {}) if isinstance(value, dict) else {}
        kept[dotted] = value
    return json.dumps(kept, sort_keys=True).encode("utf-8")


def _read(relative: str) -> bytes:
    text = (REPO / relative).read_bytes()
    if relative == "pyproject.toml":
        return installed_tables(text)
    if relative.endswith(".mk"):
        # The recipes, not their comments.
        lines = text.decode("utf-8").splitlines()
        return "\n".join(line for line in lines if not line.lstrip().startswith("#")).encode()
    if relative.startswith("docs/"):
        blocks = INSTALL_BLOCK.findall(text.decode("utf-8"))
        if not blocks:
            raise SystemExit(f"env_key: {relative} has no install block")
        return "\n".join(blocks).encode("utf-8")
    return text


def key(name: str, python_version: str) -> str:
    """The first 16 hex digits of the hash of ``name``'s inputs and interpreter version."""
    if name not in INPUTS:
        raise SystemExit(f"env_key: unknown environment {name!r}; known: {sorted(INPUTS)}")
    digest = hashlib.sha256(f"{name}\0{python_version}\0".encode())
    for relative in (*COMMON, *INPUTS[name]):
        digest.update(relative.encode() + b"\0" + _read(relative) + b"\0")
    return digest.hexdigest()[:16]


def interpreter_version(python: str) -> str:
    """``python``'s full version (``3.12.13``), which the environment is built on."""
    done = subprocess.run(
        [python, "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"env_key: {python} does not run: {done.stderr.strip()}")
    return done.stdout.strip()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python -m tests.env_key NAME PYTHON")
    print(key(argv[0], interpreter_version(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
