"""Brute-force oracles for the M2PO tests: the rules written out with Fractions, O(n^2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction


def below(kept: Sequence[Fraction], threshold: float) -> bool:
    """``mean(kept) < threshold``, exactly (``kept`` not empty)."""
    if math.isinf(threshold):
        return threshold > 0
    return sum(kept, Fraction(0)) < Fraction(threshold) * len(kept)


def value_rule_kept(values: Sequence[float], threshold: float) -> set[float]:
    """The values (as a set) kept by the value-based rule: every ``v`` with ``m2 <= c*``."""
    best: float | None = None
    for c in sorted(set(values)):
        if below([Fraction(v) for v in values if v <= c], threshold):
            best = c
    return set() if best is None else {v for v in values if v <= best}


def areal_index_rule_kept(values: Sequence[float], threshold: float) -> int:
    """How many tokens AReaL 1.0.4's ``_get_m2po_loss_mask`` keeps, in exact arithmetic.

    Sorted descending, it masks the first ``i`` values for the least ``i`` whose
    suffix mean is strictly below the threshold, and keeps one token when no
    suffix qualifies.
    """
    ordered = sorted(values, reverse=True)
    n = len(ordered)
    for i in range(n):
        if below([Fraction(v) for v in ordered[i:]], threshold):
            return n - i
    return min(n, 1)
