"""The engine boundary: the callback contract engines have, and the explicit API.

Training engines (FSDP, Megatron, ...) expose ``train_batch(input, loss_fn,
loss_weight_fn)``: ``loss_fn`` gives a microbatch's local mean,
``loss_weight_fn`` its local normalizer, and the engine scales each microbatch
by ``weight / global_weight``. That is exactly a single-term mean
:class:`LossReduction`, so :func:`train_batch_with_reduction` maps such a
reduction onto any :class:`TrainEngine` unchanged; sum terms and several terms
need an engine that implements the explicit :class:`ReductionEngine` API, and
other engines get a :class:`NotImplementedError` saying why. :class:`StepStats`
and :class:`EvalResult` are what an engine reports of one step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor

from lossreduce.errors import ReductionInputError
from lossreduce.trainer_worker.reduction import Batch, LossFn, LossReduction, NormalizerFn

__all__ = [
    "EvalResult",
    "ReductionEngine",
    "StepStats",
    "TrainEngine",
    "combine_eval",
    "eval_batch_with_reduction",
    "train_batch_with_reduction",
]


@dataclass(frozen=True)
class StepStats:
    """What one training step did on this rank.

    ``loss`` and ``terms`` are this rank's shares of the global loss (they sum
    over ranks to the global values); ``normalizers`` are the global ones,
    empty when the step was skipped. ``normalizer_wait_s`` is how long this
    rank was blocked waiting for the round, ``round_latency_s`` how long the
    round took from its start to its answer (see
    :attr:`NormalizerHandle.latency_s`); neither is in :meth:`as_dict`, which
    holds the step's numbers only.
    """

    step: int
    skipped: bool
    loss: float
    terms: dict[str, float]
    normalizers: dict[str, float]
    local_normalizers: dict[str, float]
    n_microbatches: int
    skip_reason: str = ""
    normalizer_wait_s: float = 0.0
    round_latency_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat ``dict[str, float]`` (the callback contract's return type)."""
        out = {
            "step": float(self.step),
            "skipped": 1.0 if self.skipped else 0.0,
            "loss": self.loss,
            "microbatches": float(self.n_microbatches),
        }
        out.update({f"loss/{k}": v for k, v in self.terms.items()})
        out.update({f"normalizer/{k}": v for k, v in self.normalizers.items()})
        out.update({f"local_normalizer/{k}": v for k, v in self.local_normalizers.items()})
        return out


@dataclass(frozen=True)
class EvalResult:
    """One evaluation on this rank: shares of each term's global value and their total.

    The global value of a term is the sum of its shares over ranks
    (:func:`combine_eval`); in one process the shares are the global values.
    """

    step: int
    skipped: bool
    loss: float
    terms: dict[str, float]
    normalizers: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out = {"step": float(self.step), "skipped": 1.0 if self.skipped else 0.0, "loss": self.loss}
        out.update({f"loss/{k}": v for k, v in self.terms.items()})
        out.update({f"normalizer/{k}": v for k, v in self.normalizers.items()})
        return out


def combine_eval(results_in_rank_order: Sequence[EvalResult]) -> EvalResult:
    """Every rank's :class:`EvalResult` of one step -> the global values (exact sums)."""
    if not results_in_rank_order:
        raise ReductionInputError("combine_eval needs the EvalResult of at least one rank")
    first = results_in_rank_order[0]
    steps = {r.step for r in results_in_rank_order}
    names = {tuple(r.terms) for r in results_in_rank_order}
    if len(steps) != 1 or len(names) != 1:
        raise ReductionInputError(
            f"combine_eval got results of steps {sorted(steps)} and terms {sorted(names)}"
        )
    terms = {k: math.fsum(r.terms[k] for r in results_in_rank_order) for k in first.terms}
    return EvalResult(
        step=first.step,
        skipped=any(r.skipped for r in results_in_rank_order),
        loss=math.fsum(terms.values()),
        terms=terms,
        normalizers=dict(first.normalizers),
    )


@runtime_checkable
class TrainEngine(Protocol):
    """The callback contract: ``loss_fn`` is a local mean, ``loss_weight_fn`` its weight."""

    def train_batch(
        self, input: Batch, loss_fn: LossFn, loss_weight_fn: NormalizerFn
    ) -> dict[str, float]: ...

    def eval_batch(
        self, input: Batch, loss_fn: LossFn, loss_weight_fn: NormalizerFn
    ) -> dict[str, float]: ...


@runtime_checkable
class ReductionEngine(Protocol):
    """An engine that takes a whole :class:`LossReduction` (sum and multi-term too)."""

    def train_batch_with_reduction(self, input: Batch, reduction: LossReduction) -> StepStats: ...

    def eval_batch_with_reduction(self, input: Batch, reduction: LossReduction) -> EvalResult: ...


def _as_callback(engine: object, reduction: LossReduction) -> tuple[LossFn, NormalizerFn]:
    """The (loss_fn, loss_weight_fn) pair of a single-term mean reduction."""
    term = reduction.terms[0]
    if len(reduction.terms) != 1 or term.reduction != "mean":
        raise NotImplementedError(
            f"{type(engine).__name__} only has the callback contract "
            "(train_batch(input, loss_fn, loss_weight_fn)), which expresses one mean term; "
            f"{reduction!r} needs an engine with train_batch_with_reduction"
        )

    def loss_fn(output: Tensor, microbatch: Batch) -> Tensor:
        return reduction.losses(output, microbatch)[term.name]

    return loss_fn, term.normalizer_fn


def train_batch_with_reduction(
    engine: TrainEngine | ReductionEngine, input: Batch, reduction: LossReduction
) -> dict[str, float]:
    """Train one step on ``engine`` with ``reduction``, whichever API the engine has."""
    if isinstance(engine, ReductionEngine):
        return engine.train_batch_with_reduction(input, reduction).as_dict()
    loss_fn, weight_fn = _as_callback(engine, reduction)
    return engine.train_batch(input, loss_fn, weight_fn)


def eval_batch_with_reduction(
    engine: TrainEngine | ReductionEngine, input: Batch, reduction: LossReduction
) -> dict[str, float]:
    """Evaluate ``reduction`` on ``engine``, whichever API the engine has."""
    if isinstance(engine, ReductionEngine):
        return engine.eval_batch_with_reduction(input, reduction).as_dict()
    loss_fn, weight_fn = _as_callback(engine, reduction)
    return engine.eval_batch(input, loss_fn, weight_fn)
