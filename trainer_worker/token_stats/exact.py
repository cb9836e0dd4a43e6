"""Exact integer arithmetic on float64 values.

Every finite float64 is ``M * 2**e`` with an integer ``M < 2**53``. On a grid of
unit ``2**u`` (``u`` at most the exponent of every value's lowest set bit) every
value is an integer, so a sum of them is an exact Python ``int`` however the
values are ordered or split over ranks. The global sums of
:mod:`lossreduce.trainer_worker.token_stats` and the M2PO search
(:mod:`lossreduce.trainer_worker.m2po`) both send such sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "MIN_EXPONENT",
    "decompose",
    "exact_segment_sums",
    "exact_sum_units",
    "lowest_bit_exponent",
    "ulp_exponent",
]

_DIGIT = 32
_DIGIT_MASK = (1 << _DIGIT) - 1
MIN_EXPONENT = -1074
"""The ulp exponent of the subnormals: every finite float64 is a multiple of 2**-1074."""


def ulp_exponent(x: float) -> int:
    """``e`` such that ``x`` is a multiple of ``2**e`` (its ulp; 2**-1074 for 0 and subnormals)."""
    if x == 0:
        return MIN_EXPONENT
    return max(math.frexp(x)[1] - 53, MIN_EXPONENT)


def decompose(values: Tensor) -> tuple[Tensor, Tensor]:
    """``(whole, exponent)``, both ``[n]`` int64, with ``values == whole * 2**exponent`` exactly.

    ``values``: ``[n]`` finite float64 (``whole < 2**53``)."""
    mantissa, exponent = torch.frexp(values)
    whole = (mantissa * 2.0**53).to(torch.int64)  # exact: 53 significant bits at most
    return whole, exponent.to(torch.int64) - 53


def lowest_bit_exponent(whole: Tensor, exponent: Tensor) -> int:
    """The least ``e`` over the values with ``value`` a multiple of ``2**e``: their lowest set bit.

    ``whole``, ``exponent``: ``[n]`` from :func:`decompose` of nonzero values
    (``n >= 1``). A float32 value converted to float64 keeps its 24-bit grid,
    so this is up to 29 binades above the float64 ulp of the smallest value.
    """
    magnitude = whole.abs()
    lowest = magnitude & -magnitude  # [n] the lowest set bit, a power of two <= 2**52
    bit = torch.frexp(lowest.to(torch.float64))[1].to(torch.int64) - 1  # [n] its index
    return int((exponent + bit).min())


def exact_sum_units(whole: Tensor, exponent: Tensor, unit_exponent: int) -> int:
    """``sum(whole * 2**exponent) / 2**unit_exponent``, exactly, as an int.

    ``whole``, ``exponent``: ``[n]`` from :func:`decompose` of values ``>= 0``, each
    a multiple of ``2**unit_exponent``. Each value is cut into 32-bit digits at
    its place on the grid and the digits are summed per place in int64 (exact
    for ``n < 2**30``), then combined as a Python int.
    """
    if whole.numel() == 0:
        return 0
    shift = exponent - unit_exponent  # [n]
    # A value below the grid's unit has zero low bits (it is a multiple of the
    # unit): shifting right is exact.
    whole = torch.where(shift < 0, whole >> (-shift).clamp(max=63), whole)
    shift = shift.clamp(min=0)
    place = shift // _DIGIT  # [n] index of the value's lowest digit
    offset = shift % _DIGIT
    low = (whole & _DIGIT_MASK) << offset  # [n] < 2**63
    high = (whole >> _DIGIT) << offset  # [n] < 2**53
    digits = torch.zeros(int(place.max()) + 3, dtype=torch.int64)  # [places]
    digits.index_add_(0, place, low & _DIGIT_MASK)
    digits.index_add_(0, place + 1, (low >> _DIGIT) + (high & _DIGIT_MASK))
    digits.index_add_(0, place + 2, high >> _DIGIT)
    return sum(d << (_DIGIT * i) for i, d in enumerate(digits.tolist()))


def exact_segment_sums(
    whole: Tensor, exponent: Tensor, ends: Sequence[int], units: Sequence[int]
) -> list[int]:
    """Exact sums of consecutive segments, each on its own grid, in one pass.

    Segment ``k`` is ``[ends[k], ends[k + 1])`` of ``whole``/``exponent`` (from
    :func:`decompose`); its sum is returned in units of ``2**units[k]``
    (``len(units) == len(ends) - 1``). The same digits as
    :func:`exact_sum_units`, binned per (segment, place) with one ``index_add``.
    """
    first, last = ends[0], ends[-1]
    if last <= first:
        return [0 for _ in units]
    whole, exponent = whole[first:last], exponent[first:last]
    inner = torch.tensor(list(ends[1:-1]), dtype=torch.int64)  # [segments - 1]
    segment = torch.searchsorted(inner, torch.arange(first, last), right=True)  # [n]
    shift = exponent - torch.tensor(units, dtype=torch.int64)[segment]  # [n]
    whole = torch.where(shift < 0, whole >> (-shift).clamp(max=63), whole)
    shift = shift.clamp(min=0)
    place = shift // _DIGIT  # [n]
    offset = shift % _DIGIT
    low = (whole & _DIGIT_MASK) << offset  # [n] < 2**63
    high = (whole >> _DIGIT) << offset  # [n] < 2**53
    places = int(place.max()) + 3
    bins = segment * places + place  # [n]
    digits = torch.zeros(len(units) * places, dtype=torch.int64)  # [segments * places]
    digits.index_add_(0, bins, low & _DIGIT_MASK)
    digits.index_add_(0, bins + 1, (low >> _DIGIT) + (high & _DIGIT_MASK))
    digits.index_add_(0, bins + 2, high >> _DIGIT)
    table = digits.view(len(units), places).tolist()
    return [sum(d << (_DIGIT * i) for i, d in enumerate(row)) for row in table]
