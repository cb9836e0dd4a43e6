"""The reference engine, :class:`TorchTrainEngine`, behind the engine boundary
(the contracts, results and dispatch are in :mod:`~lossreduce.trainer_worker.engine_api`
and exported here too).

:class:`TorchTrainEngine` is the reference engine: per step it computes every
term's local normalizers over all its microbatches, obtains the global
normalizers once, then per microbatch scales the loss (mean: ``v * n_b / N``,
sum: ``v / N``), runs backward, and steps the optimizer once.

The normalizers depend only on the microbatches (a ``normalizer_fn`` sees the
microbatch, never the model output), so the engine starts the round
(:meth:`GlobalNormalizer.start`) before the first microbatch's forward and
waits for it only before the first backward: the round hides behind that
forward. A failed round raises on every rank at that wait, before any
backward; the forward already done is dropped, and the gradients and the
optimizer are untouched. ``overlap=False`` waits before the first forward
instead (the order of an engine that needs the output for the normalizers).

Gradient sync: the scaled losses already divide by the *global* normalizer,
so the gradients of the ranks must be **summed**. DDP (and ``all_reduce``
with ``AVG``) divides by the world size instead; ``grad_average_world_size``
multiplies every scaled loss by that world size to undo it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lossreduce.errors import EmptyNormalizerError, ReductionConfigError
from lossreduce.trainer_worker.engine_api import (
    EvalResult,
    ReductionEngine,
    StepStats,
    TrainEngine,
    combine_eval,
    eval_batch_with_reduction,
    train_batch_with_reduction,
)
from lossreduce.trainer_worker.normalizers import GlobalNormalizer, NormalizerHandle, OnEmptyStep
from lossreduce.trainer_worker.policy_gradient import forced_local_sums
from lossreduce.trainer_worker.reduction import (
    Batch,
    LocalPartials,
    LossFn,
    LossReduction,
    NormalizerFn,
    check_local_consistency,
    floats_of,
    local_partials,
    scaled_loss,
)

__all__ = [
    "EvalResult",
    "ForwardFn",
    "ReductionEngine",
    "Splitter",
    "StepStats",
    "TorchTrainEngine",
    "TrainEngine",
    "combine_eval",
    "eval_batch_with_reduction",
    "train_batch_with_reduction",
]

Splitter = Callable[[Batch], Sequence[Batch]]
"""A rank's batch -> its microbatches (e.g. :class:`MicrobatchSplitter`)."""

ForwardFn = Callable[[nn.Module, Batch], Tensor]
"""(model, microbatch) -> model output handed to ``loss_fn``."""


def _call_model(model: nn.Module, microbatch: Batch) -> Tensor:
    output = model(microbatch)
    if not isinstance(output, Tensor):
        raise ReductionConfigError(
            f"model(microbatch) returned {type(output).__name__}; pass a forward_fn"
        )
    return output


class TorchTrainEngine:
    """The reference engine over an ``nn.Module`` (optionally DDP-wrapped).

    ``forward_fn(model, microbatch)`` produces the output handed to
    ``loss_fn`` (default: ``model(microbatch)``). ``grad_sync(model)``, when
    given, runs after the last backward and before the optimizer step (e.g.
    an ``all_reduce`` of the gradients); every trainable parameter has a
    gradient by then, zeros on a rank without microbatches.

    A rank without microbatches (whose peers have some) still runs one
    backward, of a zero loss that reaches every trainable parameter, so DDP
    and gradient hooks sync with its peers; it then steps like them.

    ``debug_check`` recomputes each microbatch's mean terms as local sums
    (under :func:`forced_local_sums`) and raises
    :class:`InconsistentNormalizerError` where ``mean * n_b != sum``; it
    relies on the mean terms being computed with
    :meth:`PolicyGradientReduction.aggregate`.

    ``overlap`` (default True): start the normalizer round before the first
    microbatch's forward and wait for it right before the first backward
    (train) or the first loss scaling (eval). False: wait before the first
    forward. The numbers are the same either way, bit for bit; only the time
    a rank spends blocked (:attr:`StepStats.normalizer_wait_s`) differs. A
    rank without microbatches has no forward to overlap and waits at once.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        normalizer: GlobalNormalizer,
        splitter: Splitter,
        *,
        forward_fn: ForwardFn = _call_model,
        on_empty_step: OnEmptyStep = "raise",
        grad_average_world_size: int = 1,
        grad_sync: Callable[[nn.Module], None] | None = None,
        debug_check: bool = False,
        start_step: int = 0,
        overlap: bool = True,
    ) -> None:
        if on_empty_step not in ("raise", "skip"):
            raise ReductionConfigError(f"on_empty_step={on_empty_step!r} must be 'raise' or 'skip'")
        if grad_average_world_size < 1:
            raise ReductionConfigError(
                f"grad_average_world_size={grad_average_world_size} must be >= 1"
            )
        if isinstance(model, DistributedDataParallel):
            ddp_world = torch.distributed.get_world_size(model.process_group)
            if grad_average_world_size != ddp_world:
                raise ReductionConfigError(
                    f"the model is DDP over {ddp_world} ranks, which averages gradients; set "
                    f"grad_average_world_size={ddp_world} (got {grad_average_world_size}) so the "
                    "scaled losses undo that division"
                )
        self.model = model
        self.optimizer = optimizer
        self.normalizer = normalizer
        self.splitter = splitter
        self.forward_fn = forward_fn
        self.on_empty_step: OnEmptyStep = on_empty_step
        self.grad_average_world_size = grad_average_world_size
        self.grad_sync = grad_sync
        self.debug_check = debug_check
        self.overlap = overlap
        self.step = start_step
        """The step number of the next reduction round (train and eval share it)."""

    def __repr__(self) -> str:
        return (
            f"TorchTrainEngine(normalizer={self.normalizer!r}, step={self.step}, "
            f"on_empty_step={self.on_empty_step!r}, overlap={self.overlap})"
        )

    # The callback contract.

    def train_batch(
        self, input: Batch, loss_fn: LossFn, loss_weight_fn: NormalizerFn
    ) -> dict[str, float]:
        return self.train_batch_with_reduction(
            input, LossReduction.mean(loss_fn, loss_weight_fn)
        ).as_dict()

    def eval_batch(
        self, input: Batch, loss_fn: LossFn, loss_weight_fn: NormalizerFn
    ) -> dict[str, float]:
        return self.eval_batch_with_reduction(
            input, LossReduction.mean(loss_fn, loss_weight_fn)
        ).as_dict()

    # The explicit API.

    def train_batch_with_reduction(self, input: Batch, reduction: LossReduction) -> StepStats:
        """One optimizer step on this rank's ``input`` (or none, if skipped)."""
        step = self._take_step()
        self.model.train()
        microbatches = list(self.splitter(input))
        local = local_partials(reduction, microbatches)
        pending = _Pending.start(self.normalizer, step, local, reduction)
        answer: _Answer | None = None
        if not (self.overlap and microbatches):
            answer = self._wait(pending)
            if answer.normalizers is None:
                return self._skipped(step, local, len(microbatches), answer)
            self.optimizer.zero_grad(set_to_none=True)
            if not microbatches:
                # The round was agreed: the peers now sync gradients, so this rank must too.
                self._zero_backward()
        shares: list[dict[str, Tensor]] = []
        for index, microbatch in enumerate(microbatches):
            last = index == len(microbatches) - 1
            with self._no_sync_unless(last):
                output = self.forward_fn(self.model, microbatch)
                losses = reduction.losses(output, microbatch)
                if self.debug_check:
                    self._check(
                        step=step,
                        index=index,
                        reduction=reduction,
                        output=output,
                        microbatch=microbatch,
                        means=losses,
                        local=local,
                    )
                if answer is None:
                    # The first forward ran while the round was in flight. A failed
                    # round raises here, before any backward; a skipped one drops
                    # this forward. Either way the gradients are untouched.
                    answer = self._wait(pending)
                    if answer.normalizers is None:
                        return self._skipped(step, local, len(microbatches), answer)
                    self.optimizer.zero_grad(set_to_none=True)
                assert answer.normalizers is not None  # a skipped round returned above
                total, term_shares = scaled_loss(
                    reduction, losses, local.per_microbatch[index], answer.normalizers
                )
                torch.autograd.backward(total * self.grad_average_world_size)
            shares.append({k: v.detach() for k, v in term_shares.items()})
        assert answer is not None  # awaited before the first backward
        assert answer.normalizers is not None
        if self.grad_sync is not None:
            for param in self.model.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
            self.grad_sync(self.model)
        self.optimizer.step()
        terms = _sum_shares(reduction, shares)
        return StepStats(
            step=step,
            skipped=False,
            loss=math.fsum(terms.values()),
            terms=terms,
            normalizers=_as_floats(answer.normalizers),
            local_normalizers=_as_floats(local.partials),
            n_microbatches=len(microbatches),
            normalizer_wait_s=answer.wait_s,
            round_latency_s=answer.latency_s,
        )

    def eval_batch_with_reduction(self, input: Batch, reduction: LossReduction) -> EvalResult:
        """This rank's shares of every term's global value, without gradients."""
        step = self._take_step()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                microbatches = list(self.splitter(input))
                local = local_partials(reduction, microbatches)
                pending = _Pending.start(self.normalizer, step, local, reduction)
                # The first output is computed while the round is in flight.
                outputs = (
                    [self.forward_fn(self.model, microbatches[0])]
                    if self.overlap and microbatches
                    else []
                )
                normalizers = self._wait(pending).normalizers
                if normalizers is None:
                    return EvalResult(step, True, 0.0, {})
                shares = []
                for index, microbatch in enumerate(microbatches):
                    output = outputs.pop() if outputs else self.forward_fn(self.model, microbatch)
                    losses = reduction.losses(output, microbatch)
                    _, term_shares = scaled_loss(
                        reduction, losses, local.per_microbatch[index], normalizers
                    )
                    shares.append(term_shares)
        finally:
            self.model.train(was_training)
        terms = _sum_shares(reduction, shares)
        return EvalResult(
            step=step,
            skipped=False,
            loss=math.fsum(terms.values()),
            terms=terms,
            normalizers=_as_floats(normalizers),
        )

    def _take_step(self) -> int:
        step = self.step
        self.step += 1
        return step

    def _wait(self, pending: _Pending) -> _Answer:
        """The round's answer, or no normalizers (with why) for a skipped empty step."""
        before = time.perf_counter()
        try:
            normalizers: dict[str, Tensor] | None = pending.handle.wait()
            reason = ""
        except EmptyNormalizerError as err:
            # Every rank gets the same error, so every rank takes the same branch.
            if self.on_empty_step != "skip":
                raise
            normalizers, reason = None, str(err)
        after = time.perf_counter()
        latency = pending.handle.latency_s
        return _Answer(
            normalizers=normalizers,
            skip_reason=reason,
            wait_s=after - before,
            latency_s=after - pending.started if latency is None else latency,
        )

    @staticmethod
    def _skipped(
        step: int, local: LocalPartials, n_microbatches: int, answer: _Answer
    ) -> StepStats:
        return StepStats(
            step=step,
            skipped=True,
            loss=0.0,
            terms={},
            normalizers={},
            local_normalizers=_as_floats(local.partials),
            n_microbatches=n_microbatches,
            skip_reason=answer.skip_reason,
            normalizer_wait_s=answer.wait_s,
            round_latency_s=answer.latency_s,
        )

    def _zero_backward(self) -> None:
        """A zero loss whose backward gives every trainable parameter a zero gradient.

        For a rank without microbatches: its peers' gradient sync (DDP's
        reducer, hooks on the parameters) needs this rank's backward too. A
        DDP model arms its reducer (and broadcasts buffers) in its forward, so
        the zeros come out of one DDP forward, with the wrapped module's
        forward standing in for the module's own; no data goes through it.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]

        def zeros() -> list[Tensor]:
            # One root per parameter: parameters may differ in device and dtype.
            return [p.sum() * 0.0 for p in params]

        if not isinstance(self.model, DistributedDataParallel):
            if params:
                torch.autograd.backward(zeros())
            return
        attributes = vars(self.model.module)
        missing = object()
        own_forward = attributes.get("forward", missing)
        attributes["forward"] = zeros
        try:
            outputs = self.model()
        finally:
            if own_forward is missing:
                del attributes["forward"]
            else:
                attributes["forward"] = own_forward
        torch.autograd.backward(outputs)

    def _no_sync_unless(self, last: bool) -> contextlib.AbstractContextManager[object]:
        # DDP syncs gradients on every backward; accumulate locally until the last one.
        if isinstance(self.model, DistributedDataParallel) and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _check(
        self,
        *,
        step: int,
        index: int,
        reduction: LossReduction,
        output: Tensor,
        microbatch: Batch,
        means: dict[str, Tensor],
        local: LocalPartials,
    ) -> None:
        with torch.no_grad(), forced_local_sums():
            sums = reduction.losses(output.detach(), microbatch)
        check_local_consistency(
            reduction,
            means,
            sums,
            local.per_microbatch[index],
            where=f"step {step} microbatch {index}",
        )


@dataclass(frozen=True)
class _Pending:
    """A started round and when this engine started it."""

    handle: NormalizerHandle
    started: float

    @classmethod
    def start(
        cls, normalizer: GlobalNormalizer, step: int, local: LocalPartials, reduction: LossReduction
    ) -> _Pending:
        started = time.perf_counter()
        return cls(normalizer.start(step, local.partials, reduction.contracts), started)


@dataclass(frozen=True)
class _Answer:
    """A round's normalizers (None: a skipped empty step, see ``skip_reason``) and its times."""

    normalizers: dict[str, Tensor] | None
    skip_reason: str
    wait_s: float
    latency_s: float


def _as_floats(values: dict[str, Tensor]) -> dict[str, float]:
    return dict(zip(values, floats_of(list(values.values())), strict=True))


def _sum_shares(reduction: LossReduction, shares: Sequence[dict[str, Tensor]]) -> dict[str, float]:
    return {name: math.fsum(float(s[name]) for s in shares) for name in reduction.names}
