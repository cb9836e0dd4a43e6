"""The global ``k``-th smallest int64 key: a K-ary search over the key range, counts only.

Each rank holds int64 keys (one per token, e.g. from
:func:`~lossreduce.trainer_worker.token_stats.float_order_keys` or
:func:`~lossreduce.trainer_worker.token_stats.draw_keys`). The search keeps a
bracket ``(low, high]`` of keys holding the ``k``-th smallest key of the union
(``keys <= low`` are fewer than ``k``, ``keys <= high`` at least ``k``). Each
round splits the bracket into segments of equal width and sends, per segment,
how many of this rank's keys it holds. The global counts are exact and the
same on every rank, so every rank moves the bracket to the same segment: the
one where the running count reaches ``k``.

The first round sends ``max_terms`` counts, one a term (``+ 1``); it tells
every rank the total. From then on the bracket's count ``C`` is known, so a
term carries as many counts as fit as digits in base ``C + world_size + 1``
(:func:`~lossreduce.trainer_worker.token_stats.wire.pack_counts`): the fewer
keys are left, the more segments a round has.

The search ends when the bracket is one key wide (the key is ``high``), or
holds one key of the union: then one more round sends that key's offset in
the bracket (the sum over ranks of at most one nonzero offset) as two
:data:`~lossreduce.trainer_worker.token_stats.wire.LIMB_BITS`-bit limbs.
:func:`kth_worst_case_rounds` bounds the rounds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lossreduce.errors import UsageError
from lossreduce.trainer_worker.normalizers.base import GlobalNormalizer
from lossreduce.trainer_worker.token_stats import wire
from lossreduce.trainer_worker.token_stats.rounds import reduce_rounds, rounds_in_process

__all__ = ["KthKey", "global_kth_smallest", "kth_smallest_in_process", "kth_worst_case_rounds"]

_WHAT = "k-th key search"
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_VALUE_LIMBS = wire.limbs_for(64)


@dataclass(frozen=True)
class KthKey:
    """The global ``k``-th smallest key, the same on every rank.

    ``threshold``: the ``min(k, total)``-th smallest key of the union of every
    rank's keys (so the largest key when ``k > total``); None when no key is
    selected (``k == 0`` or no key on any rank). ``selected``: keys ``<=
    threshold`` over all ranks: ``k`` when ``k <= total``, more when keys equal
    to the threshold lie on both sides of the ``k``-th (they are kept
    together), ``total`` when ``k > total``, 0 when ``threshold`` is None.
    ``total``: keys over all ranks. ``rounds``: normalizer rounds; ``terms_sent``:
    terms this rank sent over all rounds; ``seconds``: wall time here.
    """

    threshold: int | None
    selected: int
    total: int
    k: int
    rounds: int
    terms_sent: int
    seconds: float

    def select(self, keys: Tensor) -> Tensor:
        """Bool mask of ``keys`` (this rank's, any shape) ``<= threshold``: the selected ones."""
        if self.threshold is None:
            return torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)
        return keys <= self.threshold


class _KthSearch:
    """One rank's side of the search (see the module docstring)."""

    def __init__(self, keys: Tensor, k: int, *, world_size: int, max_terms: int) -> None:
        self.keys = keys  # [n] int64, CPU, ascending
        self.k = k
        self.world_size = world_size
        self.max_terms = max_terms
        self.low, self.high = INT64_MIN - 1, INT64_MAX
        self.below = 0  # keys <= low over all ranks
        self.upto = -1  # keys <= high over all ranks (-1: unknown until the first answer)
        self.total = -1
        self.target = 0  # min(k, total)
        self.threshold: int | None = None
        self.done = False
        self._bounds: list[int] = []
        self._base, self._per_term = wire.EXACT, 1
        self._value_round = False

    def _ends(self, bounds: Sequence[int]) -> list[int]:
        """This rank's keys ``<= b`` for each bound ``b`` (``b`` may be ``INT64_MIN - 1``)."""
        clamped = torch.tensor([max(b, INT64_MIN) for b in bounds], dtype=torch.int64)
        ends = torch.searchsorted(self.keys, clamped, right=True).tolist()
        return [0 if b < INT64_MIN else e for b, e in zip(bounds, ends, strict=True)]

    def request(self) -> dict[str, int] | None:
        if self.done:
            return None
        if self._value_round:
            first, last = self._ends([self.low, self.high])
            # At most one key of the union lies in (low, high]: its offset, or 0.
            offset = sum(key - self.low - 1 for key in self.keys[first:last].tolist())
            limbs = wire.split_limbs(offset, _VALUE_LIMBS)
            return {f"kth.v{j}": limb for j, limb in enumerate(limbs)}
        width = self.high - self.low
        self._base, self._per_term = self._digits()
        segments = min(self._per_term * self.max_terms, width)
        self._bounds = [self.low + -(-(i * width) // segments) for i in range(segments + 1)]
        ends = self._ends(self._bounds)
        counts = [ends[i + 1] - ends[i] for i in range(segments)]
        packed = wire.pack_counts(counts, self._base, self._per_term)
        return {f"kth.c{i}": term for i, term in enumerate(packed)}

    def _digits(self) -> tuple[int, int]:
        """(base, counts a term) of this round: one count a term until the total is known,
        then as many digits as fit, in a base above the bracket's count plus the + 1s."""
        if self.total < 0:
            return wire.EXACT, 1
        base = self.upto - self.below + self.world_size + 1
        return base, wire.digits_per_term(base)

    def answer(self, totals: Mapping[str, float]) -> None:
        if self._value_round:
            limbs = [totals[f"kth.v{j}"] for j in range(_VALUE_LIMBS)]
            self.threshold = self.low + 1 + wire.join_limbs(limbs, self.world_size)
            self.done = True
            return
        segments = len(self._bounds) - 1
        terms = [totals[f"kth.c{i}"] for i in range(-(-segments // self._per_term))]
        counts = wire.unpack_counts(terms, self._base, self._per_term, segments, self.world_size)
        if self.total < 0:
            self.total = self.upto = sum(counts)
            self.target = min(self.k, self.total)
            if self.target == 0:
                self.done = True
                return
        below = self.below
        for i, count in enumerate(counts):
            if below + count >= self.target:
                self.low, self.high = self._bounds[i], self._bounds[i + 1]
                self.below, self.upto = below, below + count
                break
            below += count
        else:
            raise AssertionError(f"the bracket lost the {self.target}-th key: {counts}")
        if self.high - self.low == 1:
            self.threshold, self.done = self.high, True
        elif self.upto - self.below == 1:
            self._value_round = True

    def result(self, rounds: int, terms_sent: int, started: float) -> KthKey:
        selected = 0 if self.threshold is None else self.upto
        return KthKey(
            self.threshold,
            selected,
            max(self.total, 0),
            self.k,
            rounds,
            terms_sent,
            time.perf_counter() - started,
        )


def _prepared(keys: Tensor, k: int, world_size: int, max_terms: int) -> Tensor:
    """This rank's keys, int64 on the CPU, ascending; refuses what no round can carry."""
    wire.check_world_size(world_size, what=_WHAT)
    wire.check_max_terms(max_terms, 2, what=_WHAT)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UsageError(f"k={k!r}: the k-th key search takes a whole number k >= 0")
    if keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
        raise UsageError(
            f"keys have dtype {keys.dtype}; the k-th key search takes integer keys "
            "(float values go through float_order_keys)"
        )
    flat = keys.detach().reshape(-1).to(device="cpu", dtype=torch.int64)  # [n]
    return torch.sort(flat).values


def global_kth_smallest(
    keys: Tensor,
    k: int,
    normalizer: GlobalNormalizer,
    step: int,
    *,
    rank: int,
    world_size: int,
    job: str = "",
    group: str = "",
    max_terms: int = wire.DEFAULT_MAX_TERMS,
) -> KthKey:
    """The ``k``-th smallest key over every rank's ``keys`` (collective: every rank calls it).

    ``keys``: this rank's int64 keys (any integer dtype and shape; ordered as
    signed int64; possibly empty). ``k``: the rank of the key wanted, ``>= 0``,
    the same on every rank (``k == 0`` selects nothing; ``k`` above the total
    selects every key). ``normalizer``: a backend used by these statistics only
    (round ``i`` is its step ``stats_round_step(step, i)``; give each statistic
    of a mini-batch its own ``step``). ``rank``/``world_size``: this rank's
    place in the normalizer's group (``rank`` is not sent: the keys are only
    counted); ``job``/``group`` name it in errors. ``max_terms``: terms per
    round (at least 2), at most the coordinator's.

    The result does not depend on how the keys are split over ranks. "The k
    largest values, ties kept together" is
    ``global_kth_smallest(float_order_keys(-x), k, ...).select(float_order_keys(-x))``;
    "a seeded draw of k tokens" is the same with
    ``draw_keys(seed, rows, positions)``. Ranks that pass another ``k``, world
    size or ``max_terms`` raise ``ContractMismatchError``; a bad ``k`` or
    float keys are a :class:`UsageError` before any round.
    """
    del rank  # only counts travel: every rank's terms are alike
    started = time.perf_counter()
    ordered = _prepared(keys, k, world_size, max_terms)
    search = _KthSearch(ordered, k, world_size=world_size, max_terms=max_terms)
    rounds, terms_sent = reduce_rounds(
        search,
        normalizer,
        step,
        contract=f"kth k={k} world={world_size} max_terms={max_terms}",
        device=keys.device,
        what=_WHAT,
        after_round=lambda: None,
    )
    return search.result(rounds, terms_sent, started)


def kth_smallest_in_process(
    parts: Sequence[Tensor], k: int, *, max_terms: int = wire.DEFAULT_MAX_TERMS
) -> list[KthKey]:
    """Every rank's :func:`global_kth_smallest` in one process: ``parts[r]`` is rank ``r``'s keys.

    The same rounds, each term summed over the ranks as the backends do
    (``math.fsum`` in rank order). Returns every rank's result.
    """
    started = time.perf_counter()
    world_size = len(parts)
    wire.check_world_size(world_size, what=_WHAT)
    searches = [
        _KthSearch(
            _prepared(part, k, world_size, max_terms), k, world_size=world_size, max_terms=max_terms
        )
        for part in parts
    ]
    rounds, terms_sent = rounds_in_process(searches, after_round=lambda: None)
    return [s.result(rounds, terms_sent, started) for s in searches]


def kth_worst_case_rounds(max_terms: int = wire.DEFAULT_MAX_TERMS) -> int:
    """Most rounds :func:`global_kth_smallest` takes, whatever the keys and their number.

    Each round splits a bracket of ``w`` keys into ``min(max_terms, w)``
    segments, at most ``ceil(w / max_terms)`` wide, starting from the ``2**64``
    int64 keys; the search has ended by the round that leaves one key's width
    (the extra round of a bracket holding one key comes only before that).
    11 rounds at 64 terms, 10 at 128, 8 at 256, 64 at 2.
    """
    wire.check_max_terms(max_terms, 2, what=_WHAT)
    width, rounds = 1 << 64, 0
    while width > 1:
        width = -(-width // min(max_terms, width))
        rounds += 1
    return rounds
