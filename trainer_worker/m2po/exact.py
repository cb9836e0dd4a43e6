"""Exact arithmetic on float64 ``m2`` values, and the single-process M2PO rule.

Every finite float64 is ``M * 2**e`` with an integer ``M < 2**53``. On a grid of
unit ``2**u`` (``u`` at most the smallest value's ulp exponent) every value is
an integer, so a sum of them is an exact Python ``int`` however the values are
ordered or split (:mod:`lossreduce.trainer_worker.token_stats.exact`). The
rule's comparison ``S(c) < threshold * N(c)`` is then decided exactly, with
:class:`fractions.Fraction`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

from lossreduce.errors import ReductionInputError, UsageError
from lossreduce.trainer_worker.token_stats.exact import (
    MIN_EXPONENT,
    decompose,
    exact_segment_sums,
    exact_sum_units,
    ulp_exponent,
)

__all__ = [
    "MIN_EXPONENT",
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
