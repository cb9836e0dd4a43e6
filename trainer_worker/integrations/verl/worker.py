"""verl's engine actor workers with lossreduce's validated global normalizers.

:class:`LossReduceTrainingWorker` is verl's ``TrainingWorker`` with one seam
changed: ``train_batch(data)``, which sees each *whole* PPO mini-batch (one
optimizer step) before the engine splits it into micro-batches. There, once
per mini-batch and before any forward:

1. the rank computes each row's weight and one partial normalizer per term
   (:mod:`.plan`: the policy gradient in lossreduce's mode; verl's KL loss and
   entropy bonus as ``token_mean`` terms of their own), over active units only;
2. the normalizer backend sums and validates the partials over the engine's
   data-parallel group (``engine.get_data_parallel_group()``: with Ulysses
   sequence parallelism, the ranks that hold different data; every rank of a
   sequence-parallel group holds the same rows and reduces in its own round);
3. for a policy loss that takes a statistic over its call (``clip_cov``,
   ``kl_cov``, a normalized ``bypass_mode``; :mod:`.policy_losses`), with
   ``statistics='mini_batch'``, a no-grad forward of the mini-batch gives the
   current log-probabilities and the statistic is reduced over every rank
   (:mod:`.statistics`). On the first mini-batch of a ``train_mini_batch`` call
   whose ``old_log_prob`` the trainer says the actor recomputed for it
   (:data:`OLD_LOG_PROBS_CURRENT_KEY`, which the trainer mode sets), the weights
   are those that computed ``old_log_prob``: it is taken instead of the forward
   (``reuse_old_log_prob``);
4. the micro-batches run verl's engine with :func:`.loss.micro_batch_loss`,
   which divides by those normalizers, never by verl's ``batch_num_tokens``
   or ``global_batch_size``.

Bad input gets the same answer on every rank before any backward: a NaN or
inf advantage, log-probability or importance weight at an active token makes
this rank send a NaN partial, so it raises
:class:`~lossreduce.errors.InvalidPartialError` naming itself, the input, its
value and its rows as the trainer dispatched them (whatever verl's split and
``actor.shuffle`` did), and its peers :class:`~lossreduce.errors.RoundAbortedError`
naming it. An empty mini-batch (no active token on any rank) raises
:class:`~lossreduce.errors.EmptyNormalizerError` on every rank, or with
``on_empty_step='skip'`` runs no forward, backward or optimizer step: weights,
optimizer state and its step counter stay as they were (the learning-rate
schedule still advances with verl's training steps).

The run's claim, its round counter in verl's checkpoint and the backends are
:class:`~.worker_base.ReducingTrainingWorker`'s.

:class:`LossReduceActorRolloutRefWorker` is verl's ``ActorRolloutRefWorker``
building its actor from this worker, with settings from its config's
``lossreduce`` key (``+actor_rollout_ref.lossreduce.mode=seq_mean``) over
``LOSSREDUCE_*`` variables.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from lossreduce.errors import UsageError
from lossreduce.trainer_worker.integrations.verl.launch import reduction_settings
from lossreduce.trainer_worker.integrations.verl.loss import (
    ROW_WEIGHT_KEY,
    SELECTED_KEY,
    PolicyLossRun,
    StepNormalizers,
    micro_batch_loss,
    padded,
)
from lossreduce.trainer_worker.integrations.verl.options import actor_problems, raise_problems
from lossreduce.trainer_worker.integrations.verl.parallel import computes_loss
from lossreduce.trainer_worker.integrations.verl.plan import (
    POLICY_TERM,
    MiniBatchPlan,
    dispatched_bad_inputs,
    plan_mini_batch,
)
from lossreduce.trainer_worker.integrations.verl.policy_losses import Statistic
from lossreduce.trainer_worker.integrations.verl.statistics import (
    MiniBatchStatistics,
    StatsPlace,
    clip_cov_seed,
    covariance_selection,
    mini_batch_importance_mean,
    row_identities,
)
from lossreduce.trainer_worker.integrations.verl.worker_base import (
    STATS_SUFFIX,
    ReducingTrainingWorker,
    RunClaim,
    describe_claims,
    round_metrics,
)
from lossreduce.trainer_worker.policy_gradient import zero_masked

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "OLD_LOG_PROBS_CURRENT_KEY",
    "LossReduceActorRolloutRefWorker",
    "LossReduceTrainingWorker",
    "RunClaim",
    "describe_claims",
]


OLD_LOG_PROBS_CURRENT_KEY = "lossreduce_old_log_probs_current"
"""The non-tensor field of an actor update's batch saying that its ``old_log_probs`` are
the actor's own, computed for this update with its current weights (verl's recompute;
not rollout correction's bypass mode, which takes the rollout's). The trainer mode sets
it; absent, nothing is assumed."""


class LossReduceTrainingWorker(ReducingTrainingWorker):
    """verl's ``TrainingWorker`` whose PPO mini-batches are normalized by lossreduce.

    ``reduction`` defaults to :class:`VerlReductionSettings` read from
    ``LOSSREDUCE_*``. ``skipped_steps`` counts mini-batches skipped as empty;
    ``last_normalizers`` holds the global normalizers the last mini-batch used.
    """

    role = "actor"

    def __init__(self, config: Any, reduction: Any = None) -> None:
        super().__init__(config, reduction)
        self.policy_reduction = self.reduction_settings.reduction
        self._run: PolicyLossRun | None = None
        self._old_log_probs_current = False
        """Whether the next mini-batch's old_log_probs are its current log-probabilities:
        the first of a train_mini_batch call whose batch says so."""

    # -- the loss function ----------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
        """Take verl's ``partial(ppo_loss, config=actor_config)``; refuse anything else
        (a distillation loss, an SFT loss) and every actor option lossreduce cannot honour."""
        settings = self.reduction_settings
        config = None
        if isinstance(loss_fn, functools.partial) and loss_fn.func is ppo_loss:
            config = loss_fn.keywords.get("config")
        if config is None:
            raise_problems(
                [f"loss function {loss_fn!r}: only verl's ppo_loss (actor) is supported"],
                settings,
            )
        assert config is not None  # raise_problems raised otherwise
        raise_problems(actor_problems(config, settings), settings)
        # verl's aggregation in token-sum with dp_size 1 is a plain masked sum.
        sum_config = dataclasses.replace(config, global_batch_info={"dp_size": 1})
        self._run = PolicyLossRun(sum_config, settings.statistics)
        self.loss_fn = loss_fn

    @contextmanager
    def _normalized_loss(self, normalizers: StepNormalizers, run: PolicyLossRun) -> Iterator[None]:
        # verl's own loss stays in place outside training (infer_batch may compute it).
        stock = self.loss_fn
        self.loss_fn = functools.partial(micro_batch_loss, normalizers, run)
        try:
            yield
        finally:
            self.loss_fn = stock

    # -- one mini-batch -------------------------------------------------------------

    def plan(self, data: Any) -> tuple[MiniBatchPlan, list[str]]:
        """This rank's plan for the mini-batch ``data`` and its bad inputs (if any)."""
        assert self._run is not None
        mask = padded(data["response_mask"]).bool()  # [B, R]
        config = self._run.config
        rows, index = self.step_rows(data, mask, self.policy_reduction.mode)
        plan = plan_mini_batch(
            self.policy_reduction,
            rows,
            index,
            kl=bool(config.use_kl_loss),
            entropy=config.entropy_coeff != 0,
        )
        inputs = {name: padded(data[name]) for name in ("advantages", "old_log_probs")}
        for name, wanted in (
            ("ref_log_prob", config.use_kl_loss),
            ("rollout_is_weights", "rollout_is_weights" in data.keys()),  # noqa: SIM118
        ):
            if wanted:
                inputs[name] = padded(data[name])
        found = dispatched_bad_inputs(
            mask.cpu(),
            {k: v.cpu() for k, v in inputs.items()},
            self.data_parallel()[0],
            *self.dispatched_rows(data),
        )
        return plan, found

    def statistics(self, data: Any, step: int, *, reuse: bool) -> MiniBatchStatistics | None:
        """The mini-batch's statistic, when its policy loss takes one over the whole
        mini-batch (collective: every rank of the data-parallel group calls it). ``reuse``:
        take the mini-batch's ``old_log_probs`` as its current log-probabilities instead of
        a forward (every rank decides alike: the batch's flag and the mini-batch's index)."""
        assert self._run is not None
        run = self._run
        loss = run.loss
        if not run.over_mini_batch():
            return None
        correction = run.config.policy_loss.get("rollout_correction", None)
        if loss.statistic is Statistic.IMPORTANCE_MEAN and not (
            correction is not None
            and correction.get("rollout_is", None) is not None
            and correction.get("rollout_is_batch_normalize", False)
        ):
            return None
        mask = padded(data["response_mask"]).bool().cpu()  # [B, R]
        if reuse and not computes_loss(self.engine):
            return None  # as the forward would find: no loss on this pipeline stage
        current = padded(data["old_log_probs"]).float() if reuse else self._current_log_probs(data)
        if current is None:
            return None  # a Megatron pipeline stage before the last: no loss here
        log_prob = current.cpu()  # [B, R]
        rank, world = self.data_parallel()
        _, job = self.identity()
        place = StatsPlace(
            self.normalizer(STATS_SUFFIX), step, rank, world, job, self.rounds.group(STATS_SUFFIX)
        )
        old = zero_masked(padded(data["old_log_probs"]).cpu().to(log_prob.dtype), mask)
        if loss.statistic is Statistic.IMPORTANCE_MEAN:
            found = mini_batch_importance_mean(
                correction, place, log_prob=log_prob, rollout_log_prob=old, mask=mask
            )
        else:
            found = covariance_selection(
                loss,
                run.config,
                place,
                advantages=zero_masked(padded(data["advantages"]).cpu().to(log_prob.dtype), mask),
                log_prob=zero_masked(log_prob, mask),
                old_log_prob=old,
                mask=mask,
                row_ids=_row_identities(data),
                # The job as configured, not the run-qualified one the rounds carry: a
                # rerun and a resumed run (each a run of its own) draw what the first drew.
                draw_seed=clip_cov_seed(
                    self.reduction_settings.job, run.config.data_loader_seed, step
                ),
            )
        skipped = {"lossreduce/stats/forward_skipped": float(reuse)}
        return dataclasses.replace(found, metrics={**(found.metrics or {}), **skipped})

    def _current_log_probs(self, data: Any) -> torch.Tensor | None:
        """``[B, R]`` log-probabilities of the mini-batch's responses under the current
        weights: a no-grad forward through verl's engine, micro-batched as training is.
        None where the engine computes no loss (Megatron's pipeline stages before the
        last, which run the forward with it and hold no log-probabilities)."""
        probe = data.copy()
        tu.assign_non_tensor(probe, calculate_entropy=False, **self._engine_keys(probe))
        with torch.no_grad():
            output = self.engine.forward_backward_batch(
                probe, loss_function=None, forward_only=True
            )
        if not computes_loss(self.engine):
            return None
        log_probs: torch.Tensor = no_padding_2_padding(output["model_output"]["log_probs"], data)
        return log_probs.detach().float()

    def _engine_keys(self, data: Any) -> dict[str, Any]:
        # What verl's TrainingWorker.train_batch adds before the engine sees a mini-batch.
        keys = {
            "use_remove_padding": self.model_config.get("use_remove_padding", False),
            "use_dynamic_bsz": self.engine_config.use_dynamic_bsz,
            "max_token_len_per_gpu": self.engine_config.max_token_len_per_gpu,
            "micro_batch_size_per_gpu": self.engine_config.micro_batch_size_per_gpu,
            "use_fused_kernels": self.engine_config.use_fused_kernels,
        }
        return {k: v for k, v in keys.items() if k not in data.keys()}  # noqa: SIM118

    @register(  # type: ignore[untyped-decorator]
        dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False
    )
    def train_mini_batch(self, data: Any) -> Any:
        """verl's PPO update of one batch (its mini-batches and epochs); its first
        mini-batch reuses ``old_log_probs`` for the statistics where the batch says they
        are current (:data:`OLD_LOG_PROBS_CURRENT_KEY`)."""
        self._old_log_probs_current = bool(tu.get(data, OLD_LOG_PROBS_CURRENT_KEY, default=False))
        try:
            return super().train_mini_batch(data)
        finally:
            self._old_log_probs_current = False

    @register(  # type: ignore[untyped-decorator]
        dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False
    )
    def train_batch(self, data: Any) -> Any:
        """One PPO mini-batch (one optimizer step) normalized by lossreduce."""
        if self._run is None:
            raise_problems(
                ["no loss function: call set_loss_fn(ppo_loss) first"], self.reduction_settings
            )
        assert self._run is not None
        step = self.next_round()
        # Only the first mini-batch of the call has the weights old_log_probs came from.
        reuse = self._old_log_probs_current and self.reduction_settings.reuse_old_log_prob
        self._old_log_probs_current = False
        plan, bad = self.plan(data)
        started = time.perf_counter()
        totals = self.reduce(step, plan.partials, plan.contracts, bad, POLICY_TERM)
        latency = time.perf_counter() - started
        self.last_normalizers = totals
        if totals is None:
            return self.skipped(data)
        stats = self.statistics(data, step, reuse=reuse)
        run = self._run
        if stats is not None and stats.importance_mean is not None:
            run = dataclasses.replace(run, importance_mean=stats.importance_mean)
        if stats is not None and stats.selected is not None:
            data[SELECTED_KEY] = stats.selected
        data[ROW_WEIGHT_KEY] = plan.weights.to(torch.float32)
        with self._normalized_loss(StepNormalizers(totals), run):
            output = super().train_batch(data)
        if output is not None:
            metrics = tu.get(output, "metrics")
            metrics.update(round_metrics(step, totals, latency, skipped=False))
            if stats is not None and stats.metrics:
                metrics.update(stats.metrics)
        return output


def _row_identities(data: Any) -> torch.Tensor:
    """``[B]``: :func:`~.statistics.row_identities` of the mini-batch's rows, from their
    tokens without padding (``input_ids``, nested as verl's trainer sends it, or padded
    under ``attention_mask``)."""
    ids = data["input_ids"]
    if ids.is_nested:
        return row_identities(ids.values().cpu(), ids.offsets().cpu())
    kept = data["attention_mask"].bool().cpu()  # [B, L]
    lengths = kept.sum(-1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return row_identities(ids.cpu()[kept], offsets)


class LossReduceActorRolloutRefWorker(ActorRolloutRefWorker):  # type: ignore[misc]
    """verl's ``ActorRolloutRefWorker`` whose actor is a :class:`LossReduceTrainingWorker`.

    Settings come from the worker config's ``lossreduce`` key (the launch's
    ``+actor_rollout_ref.lossreduce.<field>=...``), over ``LOSSREDUCE_*``.
    """

    def __init__(self, config: Any, role: str, distillation_config: Any = None) -> None:
        super().__init__(config, role, distillation_config=distillation_config)
        # Explicit fields win over LOSSREDUCE_* (pydantic-settings reads those in __init__).
        self.reduction_settings = reduction_settings(config.get("lossreduce", None))
        self.actor_worker_cls: Callable[..., LossReduceTrainingWorker] = functools.partial(
            LossReduceTrainingWorker, reduction=self.reduction_settings
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def claim_rounds(self) -> RunClaim:
        """The actor's :meth:`LossReduceTrainingWorker.claim`, on every rank (the trainer
        mode calls it once verl's trainer has loaded its checkpoint, or found none)."""
        actor = self.actor
        if not isinstance(actor, LossReduceTrainingWorker):
            raise UsageError(
                f"role {self.role!r}: claim_rounds needs the actor built by init_model(), "
                f"which this worker has not (actor: {type(actor).__name__})"
            )
        return actor.claim()
