"""One process: the global normalizer is the local partial, validated."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from lossreduce.errors import RankContext
from lossreduce.rules import exact_sum
from lossreduce.trainer_worker.normalizers._checks import (
    device_of,
    finish,
    local_values,
    raise_for_invalid,
)
from lossreduce.trainer_worker.normalizers.base import NormalizerHandle, ReadyHandle, _Backend

__all__ = ["LocalNormalizer"]


class LocalNormalizer(_Backend):
    """One process: the global normalizer is the local partial, validated."""

    def __init__(self, *, job: str = "local", group: str = "default") -> None:
        self.job = job
        self.group = group

    def __repr__(self) -> str:
        return f"LocalNormalizer(job={self.job!r}, group={self.group!r})"

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        """Answered at once: there is no peer to wait for."""
        return ReadyHandle(lambda: self._answer(step, partials, contracts))

    def _answer(
        self, step: int, partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None
    ) -> dict[str, Tensor]:
        rnd = RankContext(self.job, self.group, step, 0)
        terms, values, _ = local_values(rnd, partials, contracts)
        raise_for_invalid(rnd, [values], terms)
        return finish(rnd, terms, [exact_sum([v]) for v in values], device_of(partials), partials)
