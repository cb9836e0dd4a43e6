"""Exact per-term sums of a round's contributions, in rank order.

Every global normalizer is ``math.fsum`` (:func:`lossreduce.rules.exact_sum`)
over the partials of every rank, so it is bit-identical whatever order ranks
arrived in. A node aggregator's contribution carries each term's exact sum of
its ranks as a non-overlapping expansion; summing its components with the
single ranks' partials gives that same correctly rounded sum, however ranks
were grouped into nodes (see ``docs/reduction-semantics.md``).
"""

from __future__ import annotations

from lossreduce.contribution import Contribution
from lossreduce.rules import exact_sum

from .outcomes import TermNormalizerValue

__all__ = ["distinct", "sum_terms"]


def distinct(slots: list[Contribution | None]) -> list[Contribution]:
    """Each arrived contribution once, in rank order (an aggregate fills several slots)."""
    return [c for r, c in enumerate(slots) if c is not None and (not c.covers or c.covers[0] == r)]


def sum_terms(
    terms: tuple[str, ...], contributions: list[Contribution]
) -> tuple[TermNormalizerValue, ...]:
    """Each of ``terms``' exact sum over ``contributions`` (in rank order) and its zero count."""
    if any(c.covers for c in contributions):
        return _sum_aggregated(terms, contributions)
    # Rows in rank order, columns in the reference term order: [ranks, terms].
    rows = [c.values if c.terms == terms else _reorder(c, terms) for c in contributions]
    if not rows:
        return tuple(TermNormalizerValue(t, 0.0, 0) for t in terms)
    return tuple(
        TermNormalizerValue(term, exact_sum(column), column.count(0.0))
        for term, column in zip(terms, zip(*rows, strict=True), strict=True)
    )


def _sum_aggregated(
    terms: tuple[str, ...], contributions: list[Contribution]
) -> tuple[TermNormalizerValue, ...]:
    # fsum over every rank's partial and every component of every aggregate's exact
    # expansion: the same correctly rounded exact sum as over all ranks' partials.
    parts: list[list[float]] = [[] for _ in terms]  # [terms][summands]
    zeros = [0] * len(terms)
    for c in contributions:
        index = {t: i for i, t in enumerate(c.terms)}
        for k, term in enumerate(terms):
            i = index[term]
            if c.covers:
                parts[k].extend(c.expansions[i])
                zeros[k] += c.zero_ranks[i]
            else:
                parts[k].append(c.values[i])
                zeros[k] += c.values[i] == 0.0
    return tuple(
        TermNormalizerValue(term, exact_sum(summands), zero)
        for term, summands, zero in zip(terms, parts, zeros, strict=True)
    )


def _reorder(contribution: Contribution, terms: tuple[str, ...]) -> tuple[float, ...]:
    by_term = dict(zip(contribution.terms, contribution.values, strict=True))
    return tuple(by_term[t] for t in terms)
