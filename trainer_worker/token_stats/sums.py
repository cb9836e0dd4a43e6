"""Exact global sums and means over every rank's values, in two rounds of integers.

Each rank holds, per name, a 1-D tensor of float values (its tokens' advantages,
log-probabilities, importance weights...). Every value is an integer on a grid
of unit ``2**u``, so the sum of all ranks' values is an exact integer, and the
sum of a rank's values is one too: each rank sends its exact partial sums as
integer limbs, the normalizer adds them (exactly, below ``2**53``), and every
rank rebuilds the same exact total, whatever the split of the values over
ranks. Negative values are summed apart, as a second non-negative sum.

- **Round 0** sends, per name, the count of values, of positive and of
  negative values, the block of binades of the largest magnitude and of the
  finest grid (the lowest set bit of any value), and one bitmask of the ranks
  holding a NaN or infinite value. Every rank then knows the grid ``2**u`` and
  a bound ``2**E`` of the magnitudes, hence how many limbs each sum needs.
- **Round 1** sends each nonzero part's exact sum in units of ``2**u`` as
  :data:`~lossreduce.trainer_worker.token_stats.wire.LIMB_BITS`-bit limbs.

All names of a call share these rounds; a round with more terms than
``max_terms`` is sent as several rounds in a row.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from lossreduce.errors import InvalidPartialError, RankContext, RoundAbortedError, UsageError
from lossreduce.trainer_worker.normalizers.base import GlobalNormalizer
from lossreduce.trainer_worker.token_stats import wire
from lossreduce.trainer_worker.token_stats.exact import (
    decompose,
    exact_sum_units,
    lowest_bit_exponent,
)
from lossreduce.trainer_worker.token_stats.rounds import reduce_rounds, rounds_in_process

__all__ = ["ExactSum", "exact_sums_in_process", "global_exact_sums", "sums_worst_case_rounds"]

_WHAT = "global sums"
_BAD = "sum.bad"


@dataclass(frozen=True)
class ExactSum:
    """One name's values over all ranks: their count and exact sum, the same on every rank.

    ``count``: values over all ranks. ``total``: their exact sum (0 for no
    values). ``rounds``: normalizer rounds of the call that computed it (all
    its names share them).
    """

    count: int
    total: Fraction
    rounds: int

    @property
    def value(self) -> float:
        """The sum as a float64, correctly rounded from :attr:`total` (``±inf`` beyond the
        float64 range; ``0.0``, never ``-0.0``, for a zero sum)."""
        return _rounded(self.total)

    @property
    def mean(self) -> float | None:
        """The mean ``total / count`` as a float64, correctly rounded from the exact quotient;
        None when there is no value on any rank (``count == 0``): a mean of nothing is
        not a number, and the caller decides what such a step does."""
        return None if self.count == 0 else _rounded(self.total / self.count)


def _rounded(exact: Fraction) -> float:
    # int / int in Python is correctly rounded, and raises when out of range.
    try:
        return exact.numerator / exact.denominator
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


@dataclass(frozen=True)
class _Local:
    """One name's values on this rank, as round 0 and round 1 need them."""

    count: int
    bad: tuple[int, float] | None  # the first NaN or infinite value: (position, value)
    top: int | None  # block of the largest magnitude
    low: int | None  # block of the finest grid
    parts: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]  # decompose(+), decompose(-)

    @staticmethod
    def of(values: Tensor) -> _Local:
        flat = values.detach().reshape(-1).to(device="cpu", dtype=torch.float64)  # [n]
        finite = torch.isfinite(flat)
        if not bool(finite.all()):
            index = int(torch.nonzero(~finite)[0, 0])
            nothing = decompose(flat[:0])
            return _Local(flat.numel(), (index, float(flat[index])), None, None, (nothing, nothing))
        positive, negative = decompose(flat[flat > 0]), decompose(-flat[flat < 0])
        whole = torch.cat([positive[0], negative[0]])  # [nonzero]
        exponent = torch.cat([positive[1], negative[1]])
        if whole.numel() == 0:
            return _Local(flat.numel(), None, None, None, (positive, negative))
        magnitude = int((torch.frexp(flat.abs().max())[1]).item())
        return _Local(
            flat.numel(),
            None,
            wire.top_block(magnitude),
            wire.low_block(lowest_bit_exponent(whole, exponent)),
            (positive, negative),
        )


class _SumsSearch:
    """One rank's side of the global sums: round 0, then the limbs (see the module docstring).

    Each phase's terms are sent ``max_terms`` at a time; a phase is decided
    once all its terms are answered.
    """

    def __init__(
        self, local: Sequence[_Local], *, rank: int, world_size: int, max_terms: int
    ) -> None:
        self.local = local
        self.rank = rank
        self.world_size = world_size
        self.max_terms = max_terms
        self.culprits: list[int] = []
        self.counts = [0 for _ in local]
        self.unit = [0 for _ in local]
        self.sums = [0 for _ in local]  # exact (positive - negative) sums in units of 2**unit
        self._limbs: list[tuple[int, int, int]] = []  # (name index, part, limbs) of round 1
        self._queue: list[tuple[str, int]] = list(self._round_zero().items())
        self._answers: dict[str, float] = {}
        self._phase = 0

    def request(self) -> dict[str, int] | None:
        return dict(self._queue[: self.max_terms]) if self._queue else None

    def answer(self, totals: Mapping[str, float]) -> None:
        self._answers.update(totals)
        del self._queue[: len(totals)]
        if self._queue:
            return
        if self._phase == 0:
            self._phase = 1
            self._queue = list(self._round_one(self._answers).items())
        else:
            self._decide(self._answers)

    def _round_zero(self) -> dict[str, int]:
        bad = any(item.bad is not None for item in self.local)
        terms: dict[str, int] = {}
        nothing = _Local.of(torch.zeros(0))
        for i, item in enumerate(self.local):
            # A rank with an invalid value sends nothing but its bit: every rank raises.
            sent = nothing if bad else item
            positive, negative = (p[0].numel() for p in sent.parts)
            terms[f"sum{i}.n"] = sent.count + 1
            terms[f"sum{i}.pos"] = positive + 1
            terms[f"sum{i}.neg"] = negative + 1
            terms.update(wire.exponent_terms(f"sum{i}.top", sent.top, self.world_size))
            terms.update(wire.exponent_terms(f"sum{i}.low", sent.low, self.world_size))
        return {**terms, **wire.mask_terms(_BAD, self.rank, self.world_size, bad)}

    def _round_one(self, totals: Mapping[str, float]) -> dict[str, int]:
        self.culprits = wire.bad_ranks(_BAD, totals, self.world_size)
        if self.culprits:
            return {}
        terms: dict[str, int] = {}
        for i, item in enumerate(self.local):
            self.counts[i] = wire.count_of(totals[f"sum{i}.n"], self.world_size)
            tops = wire.exponent_blocks(f"sum{i}.top", totals, self.world_size)
            lows = wire.exponent_blocks(f"sum{i}.low", totals, self.world_size)
            if not tops:
                continue  # no nonzero value on any rank: the sum is 0
            self.unit[i] = wire.low_bound(lows[0])
            bound = wire.top_bound(tops[-1])  # every magnitude < 2**bound
            for part, stem in enumerate(("pos", "neg")):
                count = wire.count_of(totals[f"sum{i}.{stem}"], self.world_size)
                if count == 0:
                    continue
                # A sum of `count` values below 2**bound, in units of 2**unit.
                limbs = wire.limbs_for(bound - self.unit[i] + count.bit_length())
                self._limbs.append((i, part, limbs))
                whole, exponent = item.parts[part]
                local = exact_sum_units(whole, exponent, self.unit[i])
                for j, limb in enumerate(wire.split_limbs(local, limbs)):
                    terms[f"sum{i}.{stem}{j}"] = limb
        return terms

    def _decide(self, totals: Mapping[str, float]) -> None:
        for i, part, limbs in self._limbs:
            stem = ("pos", "neg")[part]
            exact = wire.join_limbs(
                [totals[f"sum{i}.{stem}{j}"] for j in range(limbs)], self.world_size
            )
            self.sums[i] += -exact if part else exact

    def result(self, rounds: int) -> list[ExactSum]:
        return [
            ExactSum(count, Fraction(total) * Fraction(2) ** unit, rounds)
            for count, total, unit in zip(self.counts, self.sums, self.unit, strict=True)
        ]


def _contract(names: Sequence[str], world_size: int, max_terms: int) -> str:
    """What every rank must agree on: the names (and so the terms and rounds), the world, max_terms."""
    listed = ",".join(names)
    if len(listed) > 160:  # the coordinator's max_contract_length is 256 by default
        listed = f"{len(names)} names blake2b={hashlib.blake2b(listed.encode(), digest_size=8).hexdigest()}"
    return f"sums [{listed}] world={world_size} max_terms={max_terms}"


def _prepared(values: Mapping[str, Tensor], world_size: int, max_terms: int) -> list[str]:
    """The names in sorted order (every rank lists them alike); refuses what no round can carry."""
    wire.check_world_size(world_size, what=_WHAT)
    wire.check_max_terms(max_terms, 1, what=_WHAT)
    if not values:
        raise UsageError("global_exact_sums needs at least one named tensor of values")
    for name, tensor in values.items():
        if not tensor.is_floating_point():
            raise UsageError(f"values {name!r} have dtype {tensor.dtype}; the sums take floats")
    return sorted(values)


def _raise_invalid(
    rnd: RankContext, names: Sequence[str], local: Sequence[_Local], culprits: Sequence[int]
) -> None:
    bad = [(name, item.bad) for name, item in zip(names, local, strict=True) if item.bad]
    if bad:
        described = ", ".join(f"{name!r}: value {v!r} at position {i}" for name, (i, v) in bad)
        raise rnd.error(
            InvalidPartialError,
            f"NaN or infinite values ({described}); global sums need finite values",
            terms=[name for name, _ in bad],
            values=[v for _, (_, v) in bad],
        )
    raise rnd.error(
        RoundAbortedError,
        f"global sums of {list(names)} aborted because rank(s) {list(culprits)} hold NaN or "
        "infinite values",
        terms=list(names),
        ranks=culprits,
    )


def global_exact_sums(
    values: Mapping[str, Tensor],
    normalizer: GlobalNormalizer,
    step: int,
    *,
    rank: int,
    world_size: int,
    job: str = "",
    group: str = "",
    max_terms: int = wire.DEFAULT_MAX_TERMS,
) -> dict[str, ExactSum]:
    """Exact count, sum and mean of each name's values over every rank (collective: every rank calls it).

    ``values[name]``: this rank's values, a float tensor of any float dtype
    (flattened; possibly empty; negative values allowed); every rank passes
    the same names. ``normalizer``: a backend used by these statistics only
    (round ``i`` is its step ``stats_round_step(step, i)``; give each
    statistic of a mini-batch its own ``step``). ``rank``/``world_size``: this
    rank's place in the normalizer's group; ``job``/``group`` name it in
    errors. ``max_terms``: terms per round, at most the coordinator's.

    Returns an :class:`ExactSum` per name, bit-identical on every rank and for
    every split of the values over ranks. Two rounds when each fits
    ``max_terms`` (see :func:`sums_worst_case_rounds`).

    Raises on every rank when any rank holds a NaN or infinite value:
    :class:`InvalidPartialError` there (naming each such name, the first such
    value and its position), :class:`RoundAbortedError` on its peers (naming
    the rank). Ranks that pass other names, world sizes or ``max_terms`` raise
    ``ContractMismatchError``. A non-float tensor or no name at all is a
    :class:`UsageError` on the rank that passed it, before any round.
    """
    names = _prepared(values, world_size, max_terms)
    local = [_Local.of(values[name]) for name in names]
    search = _SumsSearch(local, rank=rank, world_size=world_size, max_terms=max_terms)

    def check() -> None:
        if search.culprits:
            rnd = RankContext(job, group, wire.round_step(step, 0, what=_WHAT), rank)
            _raise_invalid(rnd, names, local, search.culprits)

    rounds, _ = reduce_rounds(
        search,
        normalizer,
        step,
        contract=_contract(names, world_size, max_terms),
        device=values[names[0]].device,
        what=_WHAT,
        after_round=check,
    )
    return dict(zip(names, search.result(rounds), strict=True))


def exact_sums_in_process(
    parts: Sequence[Mapping[str, Tensor]], *, max_terms: int = wire.DEFAULT_MAX_TERMS
) -> list[dict[str, ExactSum]]:
    """Every rank's :func:`global_exact_sums` in one process: ``parts[r]`` is rank ``r``'s values.

    The same rounds, each term summed over the ranks as the backends do
    (``math.fsum`` in rank order). Returns every rank's result; raises what
    rank 0 would when a value is invalid.
    """
    world_size = len(parts)
    wire.check_world_size(world_size, what=_WHAT)
    names = _prepared(parts[0], world_size, max_terms)
    for rank, part in enumerate(parts):
        if sorted(part) != names:
            raise UsageError(f"rank {rank} names {sorted(part)}, rank 0 {names}")
    locals_ = [[_Local.of(part[name]) for name in names] for part in parts]
    searches = [
        _SumsSearch(local, rank=r, world_size=world_size, max_terms=max_terms)
        for r, local in enumerate(locals_)
    ]

    def check() -> None:
        if searches[0].culprits:
            _raise_invalid(RankContext("", "", 0, 0), names, locals_[0], searches[0].culprits)

    rounds, _ = rounds_in_process(searches, after_round=check)
    return [dict(zip(names, s.result(rounds), strict=True)) for s in searches]


def sums_worst_case_rounds(
    names: int, world_size: int, max_terms: int = wire.DEFAULT_MAX_TERMS, *, total: int = 2**40
) -> int:
    """Most rounds :func:`global_exact_sums` takes for ``names`` names at ``world_size`` ranks.

    Round 0 sends ``3 + 2 * exponent_terms_count(world_size)`` terms a name
    (13 at 8 ranks) and one bitmask term per 50 ranks; round 1 at most two
    sums a name, each of at most ``limbs_for(2098 + bits(total))`` limbs
    (values from ``2**-1074`` to ``2**1024``; ``total``: values over all
    ranks). Each is sent ``max_terms`` terms at a time.
    """
    zero = names * (3 + 2 * wire.exponent_terms_count(world_size)) + -(
        -world_size // wire.MASK_BITS
    )
    one = names * 2 * wire.limbs_for(1024 - wire.low_bound(0) + total.bit_length())
    return -(-zero // max_terms) + -(-one // max_terms)
