"""A griffe extension for the API reference: the docstrings' reST as Markdown.

The docstrings cross-reference with Sphinx roles (``:class:`ReductionClient```)
and introduce examples with reST's ``::``, both of which Markdown would print
literally. This turns each role into the plain code span it stands for and
drops the ``::`` markers (the indented block after them is already a Markdown
code block, as double-backtick literals are already Markdown code).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

__all__ = ["SphinxRoles", "as_markdown"]

# :class:`X`, :meth:`~pkg.X.y`, :py:func:`f` ...; `~` (Sphinx: show the last
# component only) keeps the last dotted component, as Sphinx would.
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code_span(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


# A line that is only "::", or the "::" that ends a sentence ("format::").
_LITERAL_ONLY = re.compile(r"^[ \t]*::[ \t]*$", re.MULTILINE)
_LITERAL_END = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)


def as_markdown(text: str) -> str:
    """``text`` with Sphinx roles as code spans and no reST ``::`` markers."""
    text = _ROLE.sub(_code_span, text)
    text = _LITERAL_ONLY.sub("", text)
    return _LITERAL_END.sub(":", text)


class SphinxRoles(Extension):
    """Rewrites each docstring once the object tree is complete."""

    # griffe passes further keyword arguments for forward compatibility.
    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = as_markdown(obj.docstring.value)
