"""The distributed M2PO cut-off: a K-ary search over float64 bit patterns.

Every rank holds its own active tokens' ``m2`` values; each round sends, for
``K`` candidate cut-offs, the count and the exact sum of its values in each
candidate's segment, through a :class:`GlobalNormalizer` (sums only). The
answers are exact integers, the same on every rank, so every rank takes the
same branch and all arrive at the cut-off of
:func:`~lossreduce.trainer_worker.m2po.exact.m2po_cutoff_reference` over the
union of their values. See ``docs/reduction-semantics.md``, "The M2PO mask".

The wire encoding, the candidate segments and the bounds are in
:mod:`lossreduce.trainer_worker.m2po.wire`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from lossreduce.errors import InvalidPartialError, RankContext, RoundAbortedError
from lossreduce.trainer_worker.m2po.exact import (
    MIN_EXPONENT,
    admissible,
    decompose,
    exact_segment_sums,
    first_invalid,
    validate_threshold,
)
from lossreduce.trainer_worker.m2po.wire import (
    DEFAULT_MAX_TERMS,
    LIMB_BITS,
    MAX_FINITE_PATTERN,
    Segment,
    bad_ranks,
    check_world_size,
    exponent_blocks,
    float_of,
    low_bound,
    m2po_round_step,
    pattern_of,
    round_zero_terms,
    segments,
    split_limbs,
    top_bound,
    worst_case_rounds,
)
from lossreduce.trainer_worker.normalizers.base import GlobalNormalizer
from lossreduce.trainer_worker.token_stats.rounds import reduce_rounds, rounds_in_process

__all__ = ["M2POCut", "global_m2po_cutoff", "m2po_cutoff_in_process"]


@dataclass(frozen=True)
class M2POCut:
    """The global cut-off, the same on every rank.

    ``cutoff``: the kept tokens are those with ``m2 <= cutoff`` (``-inf``: none).
    It lies in ``[c*, next larger value)``, ``c*`` the reference's cut-off, so it
    keeps exactly the reference's tokens. ``kept`` / ``total``: kept and active
    tokens over all ranks. ``rounds``: normalizer rounds (round 0 included);
    ``terms_sent`` / ``wire_bytes``: terms and float64 payload bytes this rank
    sent over all rounds; ``seconds``: wall time of the whole search here.
    """

    cutoff: float
    kept: int
    total: int
    rounds: int
    terms_sent: int
    wire_bytes: int
    seconds: float

    def keep(self, m2: Tensor, mask: Tensor | None = None) -> Tensor:
        """Bool keep mask, the shape of ``m2`` (``mask``: the active tokens, same shape)."""
        kept = m2 <= self.cutoff
        return kept if mask is None else kept & mask.bool()


class _RankSearch:
    """One rank's side of the search: what to send each round, what the answer decides.

    ``request`` returns the next round's terms (None once decided); ``answer``
    takes their sums over all ranks. Every rank holds the same state after
    each answer, since the answers are exact and the same everywhere.
    """

    def __init__(
        self,
        values: Tensor,
        threshold: float,
        *,
        rank: int,
        world_size: int,
        max_terms: int,
        bad: tuple[int, float] | None = None,
    ) -> None:
        self.values = values  # [n] float64, ascending unless `bad`
        self.threshold = threshold
        self.rank = rank
        check_world_size(world_size)
        self.world_size = world_size
        self.max_terms = max_terms
        self.bad = bad
        self.culprits: list[int] = []
        self.total = -1  # unknown until round 0
        self.done = False
        # Bracket (low, high] of bit patterns: low admissible (-1: keep nothing),
        # high not (None: unknown); candidates lie in (low, top].
        self.low, self.low_count, self.low_sum = -1, 0, Fraction(0)
        self.high: int | None = None
        self.high_count = 0
        self.top = -1
        self.lowest_unit = MIN_EXPONENT
        self._segments: tuple[Segment, ...] = ()
        self._whole, self._exponent = decompose(values if bad is None else values[:0])

    def request(self) -> dict[str, int | float] | None:
        if self.done:
            return None
        if self.total < 0:
            return self._round_zero_terms()
        self._segments = segments(
            self.low,
            self.top,
            lowest_unit=self.lowest_unit,
            total=self.total,
            max_terms=self.max_terms,
        )
        patterns = self.values.view(torch.int64)  # [n], ascending as the values (all >= +0.0)
        bounds = torch.tensor([self.low] + [s.high for s in self._segments], dtype=torch.int64)
        ends = torch.searchsorted(patterns, bounds, right=True).tolist()  # values <= bound
        sums = exact_segment_sums(
            self._whole, self._exponent, ends, [s.unit for s in self._segments]
        )
        terms: dict[str, int | float] = {}
        for i, (s, segment_sum) in enumerate(zip(self._segments, sums, strict=True)):
            terms[f"m2po.k{i}.n"] = ends[i + 1] - ends[i] + 1
            for j, limb in enumerate(split_limbs(segment_sum, s.limbs)):
                terms[f"m2po.k{i}.s{j}"] = limb
        return terms

    def answer(self, totals: Mapping[str, float]) -> None:
        if self.total < 0:
            self._round_zero_answer(totals)
            return
        count, exact_sum = self.low_count, self.low_sum
        for i, s in enumerate(self._segments):
            count += self._count(totals[f"m2po.k{i}.n"])
            limbs = [totals[f"m2po.k{i}.s{j}"] for j in range(s.limbs)]
            exact_sum += Fraction(self._exact(limbs)) * Fraction(2) ** s.unit
            if not admissible(exact_sum, count, self.threshold):
                self.high, self.high_count = s.high, count
                break
            self.low, self.low_count, self.low_sum = s.high, count, exact_sum
        else:
            self.done = True  # every value admissible: keep all
            return
        self.top = self.high - 1
        # One pattern, or one value, left in (low, high]: it is not admissible.
        self.done = self.high - self.low == 1 or self.high_count - self.low_count == 1

    def _count(self, total: float) -> int:
        return round(total) - self.world_size

    def _exact(self, totals: Sequence[float]) -> int:
        return sum((round(t) - self.world_size) << (LIMB_BITS * j) for j, t in enumerate(totals))

    def _round_zero_terms(self) -> dict[str, int | float]:
        values = self.values
        nonzero = values[values > 0] if self.bad is None else values[:0]
        return dict(
            round_zero_terms(
                values.numel(),
                values.numel() - nonzero.numel() if self.bad is None else 0,
                float(nonzero[-1]) if nonzero.numel() else None,
                float(nonzero[0]) if nonzero.numel() else None,
                rank=self.rank,
                world_size=self.world_size,
                bad=self.bad is not None,
            )
        )

    def _round_zero_answer(self, totals: Mapping[str, float]) -> None:
        self.total = self._count(totals["m2po.n"])
        self.culprits = bad_ranks(totals, self.world_size)
        self.done = True
        if self.culprits or self.total == 0 or self.threshold <= 0:
            return  # an error, or nothing to keep (a mean >= 0 is never below <= 0)
        tops = exponent_blocks("top", totals, self.world_size)
        lows = exponent_blocks("low", totals, self.world_size)
        if not tops:  # every value is 0, below a threshold > 0: keep them all
            self.low, self.low_count = 0, self.total
            return
        self.lowest_unit = low_bound(lows[0])
        exponent = top_bound(tops[-1])
        limit = math.ldexp(1.0, exponent) if exponent < 1024 else math.inf
        self.top = min(pattern_of(limit) - 1, MAX_FINITE_PATTERN)
        # Every nonzero value is >= 2**lowest_unit (a multiple of its ulp), and the
        # zeros alone are admissible (threshold > 0): the bracket starts above them.
        self.low = pattern_of(math.ldexp(1.0, self.lowest_unit)) - 1
        self.low_count = self._count(totals["m2po.z"])
        # Refuse a max_terms too small for these values, on every rank alike.
        worst_case_rounds(self.total, self.max_terms, width=self.top - self.low)
        self.done = False

    def cutoff(self) -> float:
        # Nothing kept is -inf, whichever empty range below the values the bracket reached.
        return float_of(self.low) if self.low_count > 0 else -math.inf


def _prepared(m2: Tensor, mask: Tensor | None) -> tuple[Tensor, tuple[int, float] | None]:
    """(this rank's active values, float64 on the CPU, ascending; first invalid value)."""
    active = m2.detach() if mask is None else m2.detach()[mask.bool()]
    values = active.reshape(-1).to(device="cpu", dtype=torch.float64)
    bad = first_invalid(m2.detach() if mask is None else torch.where(mask.bool(), m2.detach(), 0.0))
    if bad is not None:
        return values, bad
    return torch.sort(values + 0.0).values, None  # + 0.0: -0.0 -> 0.0


def _result(search: _RankSearch, rounds: int, terms_sent: int, started: float) -> M2POCut:
    return M2POCut(
        cutoff=search.cutoff(),
        kept=search.low_count,
        total=search.total,
        rounds=rounds,
        terms_sent=terms_sent,
        wire_bytes=8 * terms_sent,
        seconds=time.perf_counter() - started,
    )


def m2po_cutoff_in_process(
    parts: Sequence[Tensor], threshold: float, *, max_terms: int = DEFAULT_MAX_TERMS
) -> list[M2POCut]:
    """Every rank's search in one process: ``parts[r]`` is rank ``r``'s ``m2`` values.

    The rounds are those :func:`global_m2po_cutoff` runs, each term summed
    over the ranks as the backends do (``math.fsum`` in rank order). Returns
    every rank's result; raises what rank 0 would when a value is invalid.
    """
    started = time.perf_counter()
    validate_threshold(threshold)
    world_size = len(parts)
    searches = []
    for rank, part in enumerate(parts):
        values, bad = _prepared(part, None)
        searches.append(
            _RankSearch(
                values, threshold, rank=rank, world_size=world_size, max_terms=max_terms, bad=bad
            )
        )
    s0 = searches[0]

    def check() -> None:
        if s0.culprits:
            _raise_invalid(RankContext("", "", 0, 0), s0.bad, s0.culprits, tuple(parts[0].shape))

    rounds, terms_sent = rounds_in_process(searches, after_round=check)
    return [_result(s, rounds, terms_sent, started) for s in searches]


def _raise_invalid(
    rnd: RankContext, bad: tuple[int, float] | None, culprits: list[int], shape: Sequence[int]
) -> None:
    if bad is not None:
        index, value = bad
        where = (
            f"row {index // shape[1]} position {index % shape[1]}"
            if len(shape) == 2
            else f"position {index}"
        )
        raise rnd.error(
            InvalidPartialError,
            f"m2 value {value!r} at {where} is NaN, infinite or negative (old or proximal "
            "log-probability not finite); the M2PO cut-off needs finite values",
            terms=["m2"],
            values=[value],
        )
    raise rnd.error(
        RoundAbortedError,
        f"M2PO cut-off aborted because rank(s) {culprits} hold NaN, infinite or negative m2 values",
        terms=["m2"],
        ranks=culprits,
    )


def global_m2po_cutoff(
    m2: Tensor,
    threshold: float,
    normalizer: GlobalNormalizer,
    step: int,
    *,
    rank: int,
    world_size: int,
    mask: Tensor | None = None,
    job: str = "",
    group: str = "",
    max_terms: int = DEFAULT_MAX_TERMS,
) -> M2POCut:
    """The global M2PO cut-off over every rank's ``m2`` values (collective: every rank calls it).

    ``m2``: this rank's values, ``[N]`` of active tokens or ``[B, T]`` with
    ``mask`` (bool ``[B, T]``, the active tokens); a rank with none takes part.
    ``threshold``: ``actor.m2_threshold``, the same on every rank (it is in the
    rounds' contract, so ranks that disagree raise ``ContractMismatchError``).
    ``normalizer``: a backend used by this search only (its rounds are steps
    ``step * M2PO_STEP_STRIDE + i``). ``rank``/``world_size``: this rank's place
    in the normalizer's group; ``job``/``group`` name it in errors.
    ``max_terms``: terms per round, at most the coordinator's ``max_terms``.

    Raises on every rank when any rank holds a NaN, infinite or negative
    value: :class:`InvalidPartialError` there (naming row and position),
    :class:`RoundAbortedError` on its peers (naming it). Every token masked is
    a result (``kept == 0``), not an error.
    """
    started = time.perf_counter()
    validate_threshold(threshold)
    values, bad = _prepared(m2, mask)
    search = _RankSearch(
        values, threshold, rank=rank, world_size=world_size, max_terms=max_terms, bad=bad
    )

    def check() -> None:
        if search.culprits:
            rnd = RankContext(job, group, m2po_round_step(step, 0), rank)
            _raise_invalid(rnd, bad, search.culprits, tuple(m2.shape))

    # The threshold rides on every round's first term (a count): ranks that
    # disagree on it raise ContractMismatchError on every rank.
    rounds, terms_sent = reduce_rounds(
        search,
        normalizer,
        step,
        contract=f"m2po threshold={threshold!r} world={world_size}",
        device=m2.device,
        what="M2PO",
        after_round=check,
    )
    return _result(search, rounds, terms_sent, started)
