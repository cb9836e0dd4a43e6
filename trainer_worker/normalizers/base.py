"""The normalizer interface and its round handles.

:class:`GlobalNormalizer` is what every backend implements, :class:`NormalizerHandle`
what its ``start`` returns while a round is in flight. ``_Round`` holds what every
handle shares (the answer or error once known, and when it came); ``_Backend``
makes ``reduce`` ``start(...).wait()``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

from lossreduce.errors import LossReduceError

__all__ = [
    "GlobalNormalizer",
    "NormalizerHandle",
    "OnEmptyStep",
    "ReadyHandle",
    "claim_run",
]

OnEmptyStep = Literal["raise", "skip"]
"""What an engine does when a global normalizer is empty; every rank receives the
same :class:`EmptyNormalizerError`, so the policy acts identically everywhere:
``raise`` re-raises it, ``skip`` runs no backward and no optimizer step and
reports the step as skipped."""


@runtime_checkable
class NormalizerHandle(Protocol):
    """A round in flight, as :meth:`GlobalNormalizer.start` returns it."""

    def done(self) -> bool:
        """True once :meth:`wait` would not block."""
        ...

    def wait(self) -> dict[str, Tensor]:
        """The round's normalizers, as ``reduce`` returns them, or its error
        (the same error again on every call)."""
        ...

    @property
    def latency_s(self) -> float | None:
        """Seconds from the start of the round to its answer (None until known).

        The answer's arrival where the backend reports it (a torch.distributed
        work future); otherwise the first :meth:`done` or :meth:`wait` that saw
        it, an upper bound."""
        ...


@runtime_checkable
class GlobalNormalizer(Protocol):
    """Sums per-term partials over all ranks of one step."""

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        """Start the round and return at once (a backend may block for a round
        trip it cannot defer; its docstring says so). Errors are raised by the
        handle's ``wait``."""
        ...

    def reduce(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, Tensor]:
        """Every term's global normalizer (float64 0-d, on the partials' device),
        in the order of ``partials``."""
        ...


class _Round:
    """A handle's shared part: the answer or error once known, and when it came.

    Subclasses say whether the answer is there (``done``) and how to collect
    it (``_collect``, called by the first ``wait`` only).
    """

    def __init__(self, started: float | None = None) -> None:
        self._started = time.perf_counter() if started is None else started
        self._answered: float | None = None
        self._result: dict[str, Tensor] | None = None
        self._error: LossReduceError | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self._answered is None else self._answered - self._started

    def _stamp(self) -> None:
        if self._answered is None:
            self._answered = time.perf_counter()

    def _collect(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def wait(self) -> dict[str, Tensor]:
        if self._result is None and self._error is None:
            try:
                self._result = self._collect()
            except LossReduceError as err:
                self._error = err
            finally:
                self._stamp()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return dict(self._result)


class ReadyHandle(_Round):
    """A round answered when it starts: ``answer`` runs at once, and ``wait``
    returns what it returned or raises what it raised.

    For one process, and for a backend with only a blocking reduce: its
    ``start`` may be ``ReadyHandle(lambda: self.reduce(step, partials, contracts))``.
    """

    def __init__(self, answer: Callable[[], dict[str, Tensor]]) -> None:
        super().__init__()
        self._answer = answer
        # A round's error is raised by wait(), like every backend's: keep it for then.
        with contextlib.suppress(LossReduceError):
            self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "answered"
        return f"ReadyHandle({state}, latency_s={self.latency_s})"

    def done(self) -> bool:
        return True

    def _collect(self) -> dict[str, Tensor]:
        return self._answer()


def _raising(error: LossReduceError) -> Callable[[], dict[str, Tensor]]:
    def answer() -> dict[str, Tensor]:
        raise error

    return answer


class _Backend:
    """What every backend shares: ``reduce`` is ``start(...).wait()``, and ``claim``
    claims nothing (only a coordinator keeps runs apart)."""

    def claim(self, step: int = 0) -> bool:
        """Claim the (job, group) for this rank's run before its first round.

        Nothing to claim here: the ranks of one process group cannot meet another
        run's rounds. :class:`CoordinatorNormalizer` overrides it. Returns False.
        """
        return False

    def start(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> NormalizerHandle:
        raise NotImplementedError

    def reduce(
        self,
        step: int,
        partials: Mapping[str, Tensor],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, Tensor]:
        return self.start(step, partials, contracts).wait()


def claim_run(normalizer: GlobalNormalizer, step: int = 0) -> bool:
    """Claim the (job, group) of ``normalizer``'s rounds for its run before the first
    round, where a coordinator keeps runs apart.

    ``step`` is the first step the run will send (0 for a new run, the step it
    continues at after a resume). Raises ``RunConflictError`` naming the holder when
    another run holds the group, so a launch that would be refused learns it at
    start-up. True when the run took the claim over (a resumed run). A normalizer
    without a ``claim`` method (one of your own, or a backend without a
    coordinator) claims nothing: False.
    """
    claim = getattr(normalizer, "claim", None)
    return bool(claim(step)) if callable(claim) else False
