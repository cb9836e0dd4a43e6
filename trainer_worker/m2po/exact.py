"""Exact arithmetic on float64 ``m2`` values, and the single-process M2PO rule.

Every finite float64 is ``M * 2**e`` with an integer ``M < 2**53``. On a grid of
unit ``2**u`` (``u`` at most the smallest value's ulp exponent) every value is
an integer, so a sum of them is an exact Python ``int`` however the values are
ordered or split. The rule's comparison ``S(c) < threshold * N(c)`` is then
decided exactly, with :class:`fractions.Fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from lossreduce.errors import ReductionInputError, UsageError

__all__ = [
    "admissible",
    "decompose",
    "exact_segment_sums",
    "exact_sum_units",
    "first_invalid",
    "m2_values",
    "m2po_cutoff_reference",
    "m2po_keep_reference",
    "ulp_exponent",
    "validate_threshold",
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


def validate_threshold(threshold: float) -> None:
    """A threshold is a number (``inf`` keeps every token, ``<= 0`` none); NaN is refused."""
    if not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise UsageError(
            f"m2_threshold={threshold!r}: the M2PO threshold must be a number, not NaN"
        )


def admissible(total: Fraction, count: int, threshold: float) -> bool:
    """Exactly ``count == 0 or total < threshold * count`` (``total``: the exact sum)."""
    if count == 0:
        return True
    if math.isinf(threshold):
        return threshold > 0
    return total < Fraction(threshold) * count


def first_invalid(m2: Tensor) -> tuple[int, float] | None:
    """(flat index, value) of the first NaN, infinite or negative ``m2`` value, or None."""
    bad = ~torch.isfinite(m2) | (m2 < 0)
    if not bool(bad.any()):
        return None
    index = int(torch.nonzero(bad.reshape(-1))[0, 0])
    return index, float(m2.reshape(-1)[index])


def m2_values(old_logp: Tensor, prox_logp: Tensor, loss_mask: Tensor) -> Tensor:
    """The second moment ``(old_logp - prox_logp)**2`` of the active tokens.

    ``old_logp``, ``prox_logp``, ``loss_mask``: ``[B, T]`` (any equal shapes).
    Returns ``[N_active]`` float64, in row-major order of the active positions;
    computed in float64, so the values do not depend on the log-probs' dtype
    beyond their own rounding. NaN or infinite log-probs give NaN or infinite
    values, which :func:`global_m2po_cutoff` refuses naming their position.
    """
    if old_logp.shape != prox_logp.shape or old_logp.shape != loss_mask.shape:
        raise ReductionInputError(
            f"old_logp {tuple(old_logp.shape)}, prox_logp {tuple(prox_logp.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have one shape"
        )
    delta = old_logp.to(torch.float64) - prox_logp.to(torch.float64)  # [B, T]
    return (delta * delta)[loss_mask.bool()]


def decompose(values: Tensor) -> tuple[Tensor, Tensor]:
    """``(whole, exponent)``, both ``[n]`` int64, with ``values == whole * 2**exponent`` exactly.

    ``values``: ``[n]`` finite float64 (``whole < 2**53``)."""
    mantissa, exponent = torch.frexp(values)
    whole = (mantissa * 2.0**53).to(torch.int64)  # exact: 53 significant bits at most
    return whole, exponent.to(torch.int64) - 53


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


def _sorted_checked(m2: Tensor) -> Tensor:
    values = m2.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    bad = first_invalid(values)
    if bad is not None:
        raise ReductionInputError(
            f"m2 value {bad[1]!r} at position {bad[0]} is NaN, infinite or negative; the M2PO "
            "mask needs finite old and proximal log-probabilities"
        )
    return torch.sort(values + 0.0).values  # + 0.0 turns -0.0 into 0.0


def m2po_cutoff_reference(m2: Tensor, threshold: float) -> tuple[float, int]:
    """``(c*, kept)``: the largest admissible ``m2`` value and how many values are ``<= c*``.

    ``m2``: every active token's value of the mini-batch (any shape). ``c*`` is
    ``-inf`` when no token is kept. Exact, single process: the reference the
    distributed :func:`global_m2po_cutoff` must equal.
    """
    validate_threshold(threshold)
    values = _sorted_checked(m2)
    n = values.numel()
    if n == 0:
        return -math.inf, 0
    # The last index of each run of equal values: the candidate cut-offs.
    ends = [*(torch.nonzero(values[1:] != values[:-1]).reshape(-1) + 1).tolist(), n]
    nonzero = values[values > 0]
    unit = ulp_exponent(float(nonzero[0])) if nonzero.numel() else MIN_EXPONENT
    whole, exponent = decompose(values)
    # Admissibility only shrinks as the cut-off grows: bisect for the last admissible end.
    low, high = 0, len(ends)  # ends[:low] admissible, ends[high:] not
    while low < high:
        mid = (low + high) // 2
        total = exact_sum_units(whole[: ends[mid]], exponent[: ends[mid]], unit)
        if admissible(Fraction(total) * Fraction(2) ** unit, ends[mid], threshold):
            low = mid + 1
        else:
            high = mid
    if low == 0:
        return -math.inf, 0
    kept = ends[low - 1]
    return float(values[kept - 1]), kept


def m2po_keep_reference(m2: Tensor, threshold: float) -> Tensor:
    """The keep mask (bool, the shape of ``m2``): ``m2 <= c*`` of :func:`m2po_cutoff_reference`."""
    cutoff, _ = m2po_cutoff_reference(m2, threshold)
    return m2 <= cutoff
