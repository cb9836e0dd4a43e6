"""The wire of the global statistics: round keys and the exact integer encoding.

A :class:`~lossreduce.trainer_worker.GlobalNormalizer` only sums named float64
partials over ranks (``math.fsum`` in rank order), refuses a partial that is not
finite and ``>= 0`` and a global that is not ``> 0``. So every value sent is a
non-negative integer plus one, and every global sum stays below ``2**53``, where
``fsum`` is exact:

- a count is sent as ``count + 1`` and an exact sum as :data:`LIMB_BITS`-bit
  limbs, each ``+ 1``; up to :data:`MAX_WORLD_SIZE` ranks, the sum of one term
  stays below ``2**53``; the decoder subtracts ``world_size``; counts whose
  global total is known to be small travel several to a term, as digits in a
  base above that total (:func:`pack_counts`);
- which block of :data:`EXPONENT_BLOCK` binades holds a rank's largest value and
  its finest grid is sent as one-hot digits in base ``world_size + 1`` (no carry:
  a digit sums at most ``world_size`` ones), so every rank learns the set of
  blocks any rank holds, hence a grid and a bound for every exact sum;
- a bitmask of the ranks holding an invalid value, :data:`MASK_BITS` ranks a
  term, so every rank learns who they are and raises in the same round.

The global sums (:mod:`lossreduce.trainer_worker.token_stats`) and the M2PO
search (:mod:`lossreduce.trainer_worker.m2po`) both use this encoding, each
under its own term names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lossreduce.errors import UsageError
from lossreduce.trainer_worker.token_stats.exact import MIN_EXPONENT

__all__ = [
    "DEFAULT_MAX_TERMS",
    "EXACT",
    "EXPONENT_BLOCK",
    "LIMB_BITS",
    "MASK_BITS",
    "MAX_WORLD_SIZE",
    "ROUND_STRIDE",
    "bad_ranks",
    "check_max_terms",
    "check_world_size",
    "count_of",
    "digits_per_term",
    "exponent_blocks",
    "exponent_terms",
    "exponent_terms_count",
    "join_limbs",
    "limbs_for",
    "low_block",
    "low_bound",
    "mask_terms",
    "pack_counts",
    "round_step",
    "split_limbs",
    "stats_round_step",
    "top_block",
    "top_bound",
    "unpack_counts",
]

DEFAULT_MAX_TERMS = 64
"""Terms per round: the coordinator's default ``max_terms`` (terms one contribution may carry)."""

ROUND_STRIDE = 256
"""Round ``i`` of a statistic of step ``step`` is reduced as normalizer step
``step * ROUND_STRIDE + i``; every search's worst case stays far below it."""

LIMB_BITS = 40
"""Bits per limb of an exact sum."""

MAX_WORLD_SIZE = 1 << (53 - LIMB_BITS)
"""Most ranks: ``MAX_WORLD_SIZE`` limbs of at most ``2**LIMB_BITS`` (with the + 1) sum exactly."""

EXPONENT_BLOCK = 32
"""Binades per block of the exponent digits (66 blocks cover every float64)."""

_BLOCKS = -(-(1024 - MIN_EXPONENT + 1) // EXPONENT_BLOCK)

MASK_BITS = 50
"""Ranks per bitmask term (a sum of distinct powers below 2**50 is exact)."""


def round_step(step: int, round_index: int, *, what: str) -> int:
    """The normalizer step of round ``round_index`` of step ``step``: ``step * ROUND_STRIDE + round_index``.

    ``what`` names the search in the error (``round_index`` outside
    ``[0, ROUND_STRIDE)``, which no search reaches)."""
    if not 0 <= round_index < ROUND_STRIDE:
        raise UsageError(
            f"{what} round {round_index} of step {step} is outside [0, {ROUND_STRIDE})"
        )
    return step * ROUND_STRIDE + round_index


def stats_round_step(step: int, round_index: int) -> int:
    """The normalizer step of round ``round_index`` of the statistic of step ``step``.

    ``step * ROUND_STRIDE + round_index``, as the M2PO search's rounds
    (:func:`~lossreduce.trainer_worker.m2po.m2po_round_step`): give these
    searches a normalizer of their own (for the coordinator, a client of a
    group such as ``"<group>.stats"``) and each statistic of one mini-batch a
    ``step`` of its own (e.g. ``2 * minibatch`` for the means and
    ``2 * minibatch + 1`` for a top-k), so no two rounds share a key.
    """
    return round_step(step, round_index, what="statistics")


def check_world_size(world_size: int, *, what: str) -> None:
    """Refuse a world size whose limbs would not sum exactly (``what`` names the search)."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(
            f"world_size={world_size}: the {what}'s exact sums support 1 to {MAX_WORLD_SIZE} ranks"
        )


def check_max_terms(max_terms: int, least: int, *, what: str) -> None:
    """Refuse ``max_terms`` below ``least``, the fewest terms a round of ``what`` needs."""
    if not isinstance(max_terms, int) or max_terms < least:
        raise UsageError(
            f"max_terms={max_terms!r}: the {what} needs at least {least} terms a round"
        )


def count_of(total: float, world_size: int) -> int:
    """The global count from the global sum of ``count + 1`` over ``world_size`` ranks."""
    return round(total) - world_size


def limbs_for(bits: int) -> int:
    """Limbs of :data:`LIMB_BITS` bits for a non-negative integer of ``bits`` bits (at least 1)."""
    return max(1, -(-bits // LIMB_BITS))


def split_limbs(value: int, limbs: int) -> list[int]:
    """``value`` (``< 2**(LIMB_BITS * limbs)``) as ``limbs`` limbs, each ``+ 1``."""
    mask = (1 << LIMB_BITS) - 1
    return [((value >> (LIMB_BITS * j)) & mask) + 1 for j in range(limbs)]


def join_limbs(totals: Sequence[float], world_size: int) -> int:
    """The exact global integer from the global sums of :func:`split_limbs`' limbs, lowest first."""
    return sum(count_of(t, world_size) << (LIMB_BITS * j) for j, t in enumerate(totals))


EXACT = 1 << 53
"""Integers below this sum exactly in float64; every global sum stays below it."""


def digits_per_term(base: int) -> int:
    """The most base-``base`` digits one term carries: the largest ``d`` with ``base**d <= 2**53``."""
    digits = 1
    while base ** (digits + 1) <= EXACT:
        digits += 1
    return digits


def pack_counts(counts: Sequence[int], base: int, per_term: int) -> list[int]:
    """``counts`` as terms of ``per_term`` base-``base`` digits each (lowest first), + 1 each term.

    Exact when every digit's sum over ranks stays below ``base`` and every
    term's sum, the ranks' + 1s included, below ``2**53``: so when ``base`` is
    at least the global count of all the counts plus ``world_size + 1``, and
    ``per_term`` at most :func:`digits_per_term` of it."""
    return [
        1 + sum(c * base**j for j, c in enumerate(counts[i : i + per_term]))
        for i in range(0, len(counts), per_term)
    ]


def unpack_counts(
    totals: Sequence[float], base: int, per_term: int, count: int, world_size: int
) -> list[int]:
    """The ``count`` global counts from the global sums of :func:`pack_counts`' terms."""
    counts: list[int] = []
    for total in totals:
        value = count_of(total, world_size)
        for _ in range(min(per_term, count - len(counts))):
            value, digit = divmod(value, base)
            counts.append(digit)
    return counts


def _digits_per_term(world_size: int) -> int:
    # Digit 0 carries the + 1 of every rank; the others one block each.
    return int(53 / math.log2(world_size + 1)) - 1


def exponent_terms_count(world_size: int) -> int:
    """Terms :func:`exponent_terms` sends for one block at ``world_size`` ranks."""
    return -(-_BLOCKS // _digits_per_term(world_size))


def exponent_terms(stem: str, block: int | None, world_size: int) -> dict[str, int]:
    """One rank's block (``None``: no value) as base ``world_size + 1`` digits, + 1 each term.

    The terms are named ``f"{stem}{i}"``."""
    per_term = _digits_per_term(world_size)
    base = world_size + 1
    return {
        f"{stem}{i}": 1
        + (base ** (block % per_term + 1) if block is not None and block // per_term == i else 0)
        for i in range(exponent_terms_count(world_size))
    }


def exponent_blocks(stem: str, totals: Mapping[str, float], world_size: int) -> list[int]:
    """The blocks any rank sent under ``stem``, ascending."""
    per_term = _digits_per_term(world_size)
    base = world_size + 1
    blocks = []
    for i in range(exponent_terms_count(world_size)):
        digits = round(totals[f"{stem}{i}"]) // base  # digit 0 holds the + 1s
        for j in range(per_term):
            if digits % base:
                blocks.append(i * per_term + j)
            digits //= base
    return blocks


def top_block(exponent: int) -> int:
    """The block of a largest value's ``frexp`` exponent (values ``< 2**exponent``)."""
    return (exponent - MIN_EXPONENT) // EXPONENT_BLOCK


def top_bound(block: int) -> int:
    """``E`` with every value of ``block`` and below ``< 2**E``."""
    return min((block + 1) * EXPONENT_BLOCK + MIN_EXPONENT - 1, 1024)


def low_block(unit: int) -> int:
    """The block of a finest grid's exponent (a value's ulp or lowest set bit)."""
    return (unit - MIN_EXPONENT) // EXPONENT_BLOCK


def low_bound(block: int) -> int:
    """A unit ``u`` dividing every nonzero value of ``block`` and above."""
    return block * EXPONENT_BLOCK + MIN_EXPONENT


def mask_terms(stem: str, rank: int, world_size: int, bad: bool) -> dict[str, int]:
    """The bitmask of ranks with an invalid value, :data:`MASK_BITS` ranks a term, + 1 each.

    The terms are named ``f"{stem}{i}"``."""
    return {
        f"{stem}{i}": 1 + (1 << (rank % MASK_BITS) if bad and rank // MASK_BITS == i else 0)
        for i in range(-(-world_size // MASK_BITS))
    }


def bad_ranks(stem: str, totals: Mapping[str, float], world_size: int) -> list[int]:
    """The ranks whose bit :func:`mask_terms` set, ascending."""
    ranks = []
    for i in range(-(-world_size // MASK_BITS)):
        bits = round(totals[f"{stem}{i}"]) - world_size
        ranks += [i * MASK_BITS + j for j in range(MASK_BITS) if bits >> j & 1]
    return ranks
