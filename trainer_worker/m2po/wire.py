"""The search's wire: round keys, candidate segments, bounds.

The encoding is :mod:`lossreduce.trainer_worker.token_stats.wire`'s, under the
term names ``m2po.*``: every value sent is an integer, so the backends'
``math.fsum`` over ranks is exact, and every global is ``> 0`` (a global
normalizer must be):

- a count is sent as ``count + 1`` and an exact sum as :data:`LIMB_BITS`-bit
  limbs, each ``+ 1``; up to :data:`MAX_WORLD_SIZE` ranks, the sum of one term
  stays below ``2**53``; the decoder subtracts ``world_size``;
- round 0 sends, in base ``world_size + 1`` digits (no carry: a digit sums at
  most ``world_size`` ones), which block of :data:`EXPONENT_BLOCK` binades
  holds each rank's largest value and its smallest nonzero value's ulp, and a
  bitmask of the ranks holding an invalid value. Every rank then knows the
  blocks of the global largest and smallest, which bound the first bracket and
  the grid of the exact sums, whatever the world size.

The segments of a round depend only on the bracket, the total count and
``max_terms``; the bracket only on the exact answers. So the search, and the
cut-off it reports, depend on the multiset of values alone, not on the world
size or the split.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from lossreduce.errors import UsageError
from lossreduce.trainer_worker.token_stats import wire
from lossreduce.trainer_worker.token_stats.exact import ulp_exponent
from lossreduce.trainer_worker.token_stats.wire import (
    DEFAULT_MAX_TERMS,
    EXPONENT_BLOCK,
    LIMB_BITS,
    MAX_WORLD_SIZE,
    limbs_for,
    low_block,
    low_bound,
    split_limbs,
    top_block,
    top_bound,
)

__all__ = [
    "DEFAULT_MAX_TERMS",
    "EXPONENT_BLOCK",
    "LIMB_BITS",
    "M2PO_STEP_STRIDE",
    "MAX_FINITE_PATTERN",
    "MAX_WORLD_SIZE",
    "Segment",
    "bad_ranks",
    "check_world_size",
    "exponent_blocks",
    "exponent_terms",
    "float_of",
    "limbs_for",
    "low_block",
    "low_bound",
    "m2po_round_step",
    "mask_terms",
    "pattern_of",
    "round_zero_terms",
    "segments",
    "split_limbs",
    "top_block",
    "top_bound",
    "worst_case_rounds",
]

M2PO_STEP_STRIDE = wire.ROUND_STRIDE
"""Round ``i`` of mini-batch ``step`` is reduced as step ``step * M2PO_STEP_STRIDE + i``;
:func:`worst_case_rounds` stays far below it."""

MAX_FINITE_PATTERN = 0x7FEFFFFFFFFFFFFF
_BINADE = 1 << 52
"""Bit patterns per binade: float64 patterns of non-negative values grow with the value."""


def float_of(pattern: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", pattern))[0])


def pattern_of(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def m2po_round_step(step: int, round_index: int) -> int:
    """The normalizer step of round ``round_index`` of mini-batch ``step``."""
    return wire.round_step(step, round_index, what="M2PO")


def check_world_size(world_size: int) -> None:
    wire.check_world_size(world_size, what="M2PO search")


def exponent_terms(name: str, block: int | None, world_size: int) -> dict[str, int]:
    """One rank's block (``None``: no value) as base ``world_size + 1`` digits, + 1 each term."""
    return wire.exponent_terms(f"m2po.{name}", block, world_size)


def exponent_blocks(name: str, totals: Mapping[str, float], world_size: int) -> list[int]:
    """The blocks any rank sent under ``name``, ascending."""
    return wire.exponent_blocks(f"m2po.{name}", totals, world_size)


def round_zero_terms(
    count: int,
    zeros: int,
    largest: float | None,
    smallest: float | None,
    *,
    rank: int,
    world_size: int,
    bad: bool,
) -> dict[str, int]:
    """Round 0: the counts (all, zeros), the exponent blocks of the largest and smallest nonzero values, bad ranks."""
    top = None if largest is None else top_block(math.frexp(largest)[1])
    low = None if smallest is None else low_block(ulp_exponent(smallest))
    return {
        "m2po.n": count + 1,
        "m2po.z": zeros + 1,
        **exponent_terms("top", top, world_size),
        **exponent_terms("low", low, world_size),
        **mask_terms(rank, world_size, bad),
    }


@dataclass(frozen=True)
class Segment:
    """Candidate segment ``(low, high]`` of bit patterns, its grid and its limbs."""

    low: int
    high: int
    unit: int
    limbs: int


def _segment(a: int, b: int, lowest_unit: int, total: int) -> Segment:
    # Every value in (a, b] is a multiple of its grid unit and below 2**top.
    unit = max(lowest_unit, ulp_exponent(float_of(a + 1)))
    top = math.frexp(float_of(b))[1]
    return Segment(a, b, unit, limbs_for(max(top - unit, 0) + total.bit_length()))


@functools.lru_cache(maxsize=64)
def segments(
    low: int, top: int, *, lowest_unit: int, total: int, max_terms: int
) -> tuple[Segment, ...]:
    """Equal-width segments of ``(low, top]`` whose counts and sums fit ``max_terms``.

    The most that fit, found by bisection on their number (at least two while
    ``top - low >= 2``: one candidate alone would not narrow the bracket);
    deterministic, so every rank finds the same (and ranks in one process share
    it through the cache).
    """
    width = top - low

    def split(k: int) -> list[Segment]:
        bounds = [low + -(-(i * width) // k) for i in range(k + 1)]
        return [_segment(a, b, lowest_unit, total) for a, b in itertools.pairwise(bounds)]

    def fits(found: list[Segment]) -> bool:
        return sum(1 + s.limbs for s in found) <= max_terms

    least = min(2, width)
    best = split(least)
    if not fits(best):
        raise UsageError(
            f"max_terms={max_terms} is too small for {least} M2PO candidates (a count and "
            f"{max(s.limbs for s in best)} limbs of {LIMB_BITS} bits each)"
        )
    good, bad = least, min(max_terms, width) + 1  # split(good) fits; split(bad) is not tried
    while bad - good > 1:
        mid = (good + bad) // 2
        found = split(mid)
        if fits(found):
            good, best = mid, found
        else:
            bad = mid
    return tuple(best)


def _worst_limbs(width: int, total: int) -> int:
    # A segment of `width` patterns spans at most width / 2**52 + 1 binades; its
    # values' exponents then exceed its grid's unit by at most that + 53.
    return limbs_for(-(-width // _BINADE) + 54 + total.bit_length())


def worst_case_rounds(
    total: int, max_terms: int = DEFAULT_MAX_TERMS, *, width: int = MAX_FINITE_PATTERN + 1
) -> int:
    """Most rounds (round 0 included) the search takes for ``total`` values over all ranks.

    ``width``: bit patterns of the first candidates' range (by default every
    finite float64; round 0 narrows it to the blocks of binades holding the
    values). Each round splits the range into the most segments that fit
    ``max_terms``, with the most limbs a segment of their width can need, and
    keeps one less its top; the search ends when no candidate is left. Raises
    :class:`UsageError` when ``max_terms`` does not fit two candidates.
    """
    rounds = 1
    while width >= 1:
        k = min(max_terms, width)
        while k > 1 and k * (1 + _worst_limbs(-(-width // k), total)) > max_terms:
            k -= 1
        if k == 1 and width > 1:
            raise UsageError(
                f"max_terms={max_terms} is too small for the M2PO search over {total} values "
                f"spread over {-(-width // _BINADE)} binades"
            )
        width = -(-width // k) - 1
        rounds += 1
    return rounds


def mask_terms(rank: int, world_size: int, bad: bool) -> dict[str, int]:
    """The bitmask of ranks with an invalid value, :data:`~lossreduce.trainer_worker.token_stats.wire.MASK_BITS` ranks a term, + 1 each."""
    return wire.mask_terms("m2po.bad", rank, world_size, bad)


def bad_ranks(totals: Mapping[str, float], world_size: int) -> list[int]:
    return wire.bad_ranks("m2po.bad", totals, world_size)
