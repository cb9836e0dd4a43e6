"""The workload every contender of ``lossreduce bench`` reduces, written once.

Each round, every rank sends one partial per term of :data:`TERMS`; every
contender must hand every rank the per-term sums. The values are a pure
function of (rank, term, step), so each load process checks the sums it
received without talking to anyone, and no contender can pass by returning
stale or partial sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "CONTRACT",
    "TERMS",
    "WrongSumError",
    "check_sums",
    "expected_sums",
    "partials_for",
]

TERMS: tuple[str, ...] = ("tokens", "sequences", "prompt_groups", "kl_tokens")
"""The four named partials each rank sends per round, in term order."""

CONTRACT = "sum:token_mean"
"""The reduction contract every rank declares for every term."""


class WrongSumError(RuntimeError):
    """A contender handed a rank sums that are not the workload's sums."""


def partials_for(rank: int, step: int) -> tuple[float, ...]:
    """Rank ``rank``'s partials at ``step``, in term order: finite, >= 0, and
    not exactly representable sums (tenths), so summation order would show."""
    base = (rank % 97) + 1 + step % 13
    return tuple(base * (t + 1) * 0.1 for t in range(len(TERMS)))


def expected_sums(world_size: int, step: int) -> tuple[float, ...]:
    """The correctly rounded per-term sums over every rank, in term order."""
    columns = zip(*(partials_for(r, step) for r in range(world_size)), strict=True)
    return tuple(math.fsum(column) for column in columns)


def check_sums(
    contender: str,
    rank: int,
    step: int,
    got: Sequence[float],
    expected: Sequence[float],
    *,
    exact: bool,
) -> None:
    """Raise when ``got`` is not the expected per-term sums. ``exact`` demands
    bit-identical values; otherwise a relative 1e-9 (plain float addition)."""
    if len(got) != len(expected):
        raise WrongSumError(
            f"{contender}: rank {rank} step {step} received {len(got)} sums, expected {len(expected)}"
        )
    for term, g, e in zip(TERMS, got, expected, strict=True):
        ok = g == e if exact else math.isclose(g, e, rel_tol=1e-9)
        if not ok:
            raise WrongSumError(
                f"{contender}: rank {rank} step {step} term {term!r} received {g!r}, expected {e!r}"
            )
