"""Every Python package in the source folders is in the wheel.

pyproject.toml lists the packages by hand (the import names are mapped onto
top-level folders), so a new subpackage that is not listed works in an
editable install and is missing from a built one: ``lossreduce train
--engine areal`` failed that way in an environment built as the AReaL page
says (``No module named 'lossreduce.trainer_worker.train.engines.areal'``).
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_source_package_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base).parts
            found.add(".".join((name, *relative)))
    assert found - listed == set(), "packages missing from pyproject.toml's [tool.setuptools]"
