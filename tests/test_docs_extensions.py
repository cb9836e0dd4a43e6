"""The API reference's griffe extension turns the docstrings' reST into Markdown."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import griffe

EXTENSION = Path(__file__).resolve().parents[1] / "docs" / "extensions" / "sphinx_roles.py"


def load_as_markdown() -> Callable[[str], str]:
    spec = importlib.util.spec_from_file_location("sphinx_roles", EXTENSION)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    as_markdown: Callable[[str], str] = module.as_markdown
    return as_markdown


def test_roles_become_code_spans() -> None:
    as_markdown = load_as_markdown()
    assert as_markdown("a :class:`ReductionClient` b") == "a `ReductionClient` b"
    assert as_markdown(":meth:`~lossreduce.client.ReductionClient.reduce`") == "`reduce`"
    assert as_markdown(":py:func:`serve` and :mod:`lossreduce.errors`") == (
        "`serve` and `lossreduce.errors`"
    )
    # Double-backtick literals are Markdown already; text without roles is kept.
    assert as_markdown("``job`` and `x` :: y") == "``job`` and `x` :: y"


def test_literal_markers_are_dropped_and_the_block_stays_indented() -> None:
    as_markdown = load_as_markdown()
    text = "Use it::\n\n    with client:\n        pass\n\nOr\n\n::\n\n    x = 1\n"
    assert as_markdown(text) == "Use it:\n\n    with client:\n        pass\n\nOr\n\n\n\n    x = 1\n"


def test_griffe_loads_the_extension_from_its_file() -> None:
    # As mkdocs.yml names it: a file path and the class in it.
    extensions = griffe.load_extensions(f"{EXTENSION}:SphinxRoles")
    module = griffe.visit(
        "example",
        filepath=Path("example.py"),
        code='def f() -> None:\n    """Calls :func:`g`."""\n',
        extensions=extensions,
    )
    extensions.call("on_object", obj=module["f"], loader=None)
    assert module["f"].docstring is not None
    assert module["f"].docstring.value == "Calls `g`."
