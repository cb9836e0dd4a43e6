"""The validation rules every side applies, written once.

The coordinator's round table, the client and the in-process normalizer
backends (local, torch.distributed) all call these functions, so a partial or
a global normalizer is judged the same way wherever it is reduced, and the
reasons match the ``reason`` label of the metrics and the ``ErrorInfo`` detail.
See ``docs/reduction-semantics.md``, "Validation".
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from lossreduce._compat import StrEnum

__all__ = [
    "MAX_TERM_NAME_LENGTH",
    "TERM_NAME_PATTERN",
    "PartialProblem",
    "check_global_normalizer",
    "check_partial",
    "check_term_name",
    "exact_sum",
]

MAX_TERM_NAME_LENGTH = 64
"""Longest accepted term name, in characters."""

TERM_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
"""Term names are identifiers (dots and dashes allowed after the first character)."""


class PartialProblem(StrEnum):
    """Why a local partial or a global normalizer is rejected (a metric label)."""

    NAN = "nan"
    INFINITE = "infinite"
    NEGATIVE = "negative"
    ZERO = "zero"


def check_partial(value: float) -> PartialProblem | None:
    """A rank's partial must be finite and >= 0; return the problem or None."""
    if math.isnan(value):
        return PartialProblem.NAN
    if math.isinf(value):
        return PartialProblem.INFINITE
    if value < 0:
        return PartialProblem.NEGATIVE
    return None


def check_global_normalizer(value: float) -> PartialProblem | None:
    """A global normalizer must be finite and > 0; return the problem or None."""
    problem = check_partial(value)
    if problem is None and value == 0:
        return PartialProblem.ZERO
    return problem


def check_term_name(name: str) -> str | None:
    """Return why ``name`` is not an acceptable term name, or None."""
    if not name:
        return "term names must be non-empty"
    if len(name) > MAX_TERM_NAME_LENGTH:
        return f"term name {name[:16]!r}... is {len(name)} characters long; the limit is {MAX_TERM_NAME_LENGTH}"
    if TERM_NAME_PATTERN.fullmatch(name) is None:
        return f"term name {name!r} must match {TERM_NAME_PATTERN.pattern}"
    return None


def exact_sum(values_in_rank_order: Iterable[float]) -> float:
    """The correctly rounded sum of the partials.

    ``math.fsum`` rounds the exact sum once, so the result does not depend on
    the order in which ranks arrived: every rerun over the same data gives a
    bit-identical global normalizer.
    """
    values = list(values_in_rank_order)
    try:
        return math.fsum(values)
    except OverflowError:
        # fsum refuses when a partial sum leaves the double range. Scaling by a
        # power of two is exact except for subnormals, which cannot change a
        # sum of non-negative partials this large; the result is then the
        # correctly rounded one: an infinity when the exact sum is out of range.
        scale = 2.0**-64
        return math.fsum(v * scale for v in values) / scale
