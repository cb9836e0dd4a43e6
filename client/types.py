"""The values a client call takes and returns: :data:`PartialValue` in,
:class:`RoundResult` out (both re-exported by :mod:`lossreduce.client`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

__all__ = ["PartialValue", "RoundResult", "SupportsItem"]


@runtime_checkable
class SupportsItem(Protocol):
    """A scalar container such as a 0-d ``torch.Tensor`` or a numpy scalar."""

    def item(self) -> float | int: ...


PartialValue: TypeAlias = float | int | SupportsItem
"""What ``reduce`` accepts as a partial: a Python number or a 0-d tensor."""


@dataclass(frozen=True)
class RoundResult:
    """The answer to one round: the same for every rank of the round.

    ``normalizers`` maps each term to its global normalizer (finite and > 0),
    in the order this rank sent its terms; ``zero_ranks`` maps each term to
    how many ranks sent a partial of 0 for it (ranks with no active unit
    locally).
    """

    step: int
    normalizers: Mapping[str, float]
    zero_ranks: Mapping[str, int]
