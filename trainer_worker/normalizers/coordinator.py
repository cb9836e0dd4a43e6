"""The reduction coordinator over gRPC, through a connected client."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor

from lossreduce.errors import LossReduceError, RankContext
from lossreduce.trainer_worker.normalizers._checks import (
    device_of,
    finish,
    malformed_error,
    request_problems,
)
from lossreduce.trainer_worker.normalizers.base import NormalizerHandle, _Backend, _Round
from lossreduce.trainer_worker.reduction import floats_of

__all__ = ["CoordinatorNormalizer", "SupportsClaim", "SupportsReduce", "SupportsResult"]


class SupportsResult(Protocol):
    """A coordinator round in flight (:class:`lossreduce.client.PendingReduction`)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> dict[str, float]: ...


class SupportsReduce(Protocol):
    """What :class:`CoordinatorNormalizer` needs of the coordinator client
    (:class:`lossreduce.client.ReductionClient`): its identity and ``reduce_start``."""

    @property
    def job(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def reduce_start(
        self,
        step: int,
        partials: Mapping[str, float],
        contracts: Mapping[str, str] | None = None,
    ) -> SupportsResult: ...


@runtime_checkable
class SupportsClaim(Protocol):
    """A client that can claim its (job, group) for its run before the first round
    (:meth:`lossreduce.client.ReductionClient.claim`)."""

    @property
    def run(self) -> str: ...

    def claim(self, step: int = 0) -> bool: ...


class _PendingRound(_Round):
    """A coordinator round in flight; ``collect`` turns the client's answer into
    the normalizers (or the error) once it is there."""

    def __init__(
        self,
        pending: SupportsResult,
        collect: Callable[[SupportsResult], dict[str, Tensor]],
        started: float,
    ) -> None:
        super().__init__(started)
        self._pending = pending
        self._collect_from = collect

    def __repr__(self) -> str:
        return f"_PendingRound({self._pending!r})"

    def done(self) -> bool:
        finished = self._pending.done()
        if finished:
            self._stamp()
        return finished

    def _collect(self) -> dict[str, Tensor]:
        return self._collect_from(self._pending)


class CoordinatorNormalizer(_Backend):
    """The reduction coordinator over gRPC, through a connected client.

    The coordinator applies the rules of :mod:`lossreduce.rules` to every
    rank's partials and answers every rank with the same normalizers or the
    same error type; the client raises it here, naming the client's job,
    group and rank. Partials are not pre-validated: an invalid one must reach
    the coordinator so that the peers learn of it (:class:`RoundAbortedError`)
    instead of timing out. A malformed request is sent too, with a NaN partial
    for every term it names, so the coordinator aborts the round for the
    peers; this rank then raises :class:`InvalidPartialError` saying what was
    malformed (chained to the coordinator's answer).

    ``start`` sends the partials with the client's ``reduce_start`` and
    returns without waiting for the answer.
    """

    def __init__(self, client: SupportsReduce) -> None:
        self.client = client

    def __repr__(self) -> str:
        return f"CoordinatorNormalizer({self.client!r})"

    def claim(self, step: int = 0) -> bool:
        """Claim the client's (job, group) for its run before the first round.

        ``step`` is the first step the run will send (0 for a new run, the step it
        continues at after a resume). One blocking round trip: a launch another
        run's claim would refuse raises :class:`lossreduce.errors.RunConflictError`
        (naming the holder) here, at start-up, instead of at its first round.
        Returns True when the run took the claim over (a resumed run). A client
        without ``claim`` (or without a run id) claims at its first round instead:
        returns False.
        """
        client = self.client
        if not isinstance(client, SupportsClaim) or not client.run:
            return False
        return client.claim(step)

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        started = time.perf_counter()
        client = self.client
        rnd = RankContext(client.job, client.group, step, client.rank)
        problems = request_problems(partials, contracts)
        if not problems:
            names = list(partials)
            values = dict(zip(names, floats_of([partials[t] for t in names]), strict=True))
            device = device_of(partials)

            def answer(pending: SupportsResult) -> dict[str, Tensor]:
                got = pending.result()
                terms = sorted(got)
                if terms != sorted(partials):
                    raise rnd.error(
                        LossReduceError,
                        f"the coordinator answered terms {terms} for partials {sorted(partials)}",
                        terms=sorted(set(terms) ^ set(partials)),
                    )
                return finish(rnd, terms, [got[t] for t in terms], device, names)

            return _PendingRound(client.reduce_start(step, values, contracts), answer, started)
        named = [*partials, *(t for t in contracts or {} if t not in partials)]
        local = malformed_error(rnd, problems, named)
        poisoned = dict.fromkeys(named, math.nan)

        def malformed(pending: SupportsResult) -> dict[str, Tensor]:
            try:
                pending.result()
            except LossReduceError as answer:
                raise local from answer
            raise local

        sent = client.reduce_start(step, poisoned, {t: (contracts or {}).get(t, "") for t in named})
        return _PendingRound(sent, malformed, started)
