"""Exact sums that survive being summed again: non-overlapping float expansions.

A node-local aggregator cannot send the rounded sum of its ranks' partials:
rounding there and again at the coordinator would make the global normalizer
depend on how ranks were grouped. It sends the *exact* sum instead, as
Shewchuk's non-overlapping expansion (the ``partials`` list of the classic
``msum`` recipe that ``math.fsum`` is built on): a few doubles whose exact
sum is the exact sum of the inputs. ``math.fsum`` over every component of
every node's expansion is then the correctly rounded exact total, which is
bit-identical to ``math.fsum`` over all ranks' partials.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["ExpansionOverflowError", "exact_expansion"]


class ExpansionOverflowError(ArithmeticError):
    """The exact sum exceeds the double range; it has no finite expansion."""


def exact_expansion(values: Iterable[float]) -> tuple[float, ...]:
    """Non-overlapping components, smallest magnitude first, whose exact sum is
    the exact sum of ``values`` (finite doubles). Zero components are dropped,
    so an all-zero input gives ``()``.

    Raises :class:`ExpansionOverflowError` when an intermediate sum overflows.
    """
    partials: list[float] = []
    for value in values:
        x = value
        kept = 0
        for partial in partials:
            y = partial
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)  # the exact rounding error of hi (Knuth/Dekker two-sum)
            if lo:
                partials[kept] = lo
                kept += 1
            x = hi
        if not math.isfinite(x):
            raise ExpansionOverflowError(f"the exact sum overflows the double range at {value!r}")
        partials[kept:] = [x] if x else []
    return tuple(partials)
