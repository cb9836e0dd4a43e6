"""Running a search's rounds: through a normalizer, or every rank in one process.

A search is one rank's side of a collective computation that only needs sums:
:meth:`RankSearch.request` gives the next round's terms (non-negative integers,
or None once decided), :meth:`RankSearch.answer` takes their sums over all
ranks. The answers are exact and the same on every rank, so every rank holds
the same state after each round and all take the same branch.
:func:`reduce_rounds` runs one rank's search through a
:class:`~lossreduce.trainer_worker.GlobalNormalizer`;
:func:`rounds_in_process` runs every rank's search in one process, each term
summed over the ranks as the backends sum it (``math.fsum`` in rank order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from lossreduce.rules import exact_sum
from lossreduce.trainer_worker.normalizers.base import GlobalNormalizer
from lossreduce.trainer_worker.token_stats.wire import round_step

__all__ = ["RankSearch", "reduce_rounds", "rounds_in_process"]


class RankSearch(Protocol):
    """One rank's side of a search over sums (see the module docstring)."""

    def request(self) -> Mapping[str, float] | None:
        """The next round's terms (the same names on every rank), or None once decided."""
        ...

    def answer(self, totals: Mapping[str, float]) -> None:
        """Take the round's sums over all ranks."""
        ...


def reduce_rounds(
    search: RankSearch,
    normalizer: GlobalNormalizer,
    step: int,
    *,
    contract: str,
    device: torch.device,
    what: str,
    after_round: Callable[[], None],
) -> tuple[int, int]:
    """Run ``search`` through ``normalizer``; returns (rounds, terms sent).

    Round ``i`` is normalizer step ``round_step(step, i)``. ``contract`` rides on
    the first term of every round, so ranks that disagree on it raise
    ``ContractMismatchError`` on every rank in the first round. The partials
    travel on ``device`` (the caller's tensors' device: NCCL needs CUDA).
    ``after_round`` runs after each answer (it raises what the answer decided).
    """
    rounds = terms_sent = 0
    while (terms := search.request()) is not None:
        names = list(terms)
        row = torch.tensor([float(terms[t]) for t in names], dtype=torch.float64)  # [terms]
        partials = dict(zip(names, row.to(device).unbind(0), strict=True))
        contracts = {t: contract if i == 0 else "" for i, t in enumerate(names)}
        got = normalizer.reduce(round_step(step, rounds, what=what), partials, contracts)
        totals = torch.stack([got[t] for t in names]).to("cpu").tolist()  # one device sync
        search.answer(dict(zip(names, totals, strict=True)))
        rounds += 1
        terms_sent += len(names)
        after_round()
    return rounds, terms_sent


def rounds_in_process(
    searches: Sequence[RankSearch], *, after_round: Callable[[], None]
) -> tuple[int, int]:
    """Run every rank's search in one process (``searches[r]``: rank ``r``'s); returns (rounds, terms sent).

    Each term is summed over the ranks as the backends do (``math.fsum`` in
    rank order). ``after_round`` runs after each answer.
    """
    rounds = terms_sent = 0
    while True:
        requests = [s.request() for s in searches]
        first = requests[0]
        if first is None:
            return rounds, terms_sent
        names = list(first)
        totals = {t: exact_sum(r[t] for r in requests if r is not None) for t in names}
        for s in searches:
            s.answer(totals)
        rounds += 1
        terms_sent += len(names)
        after_round()
