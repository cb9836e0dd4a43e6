"""verl's critic (PPO with ``algorithm.adv_estimator=gae``) with lossreduce's normalizer.

verl trains the critic with its own ``TrainingWorker`` and ``value_loss``: the
clipped value loss ``0.5 * max((V - R)^2, (clip(V) - R)^2)`` per token, divided by
verl's float32 ``batch_num_tokens`` (or its ``global_batch_size``), with no
validation. :class:`LossReduceCriticWorker` keeps verl's per-token value loss
(``compute_value_loss``, called with ``loss_agg_mode='token-sum'``) and gives it
a normalizer of its own, the term ``vf`` in group ``critic``, in the mode the
settings' ``critic_mode`` names (``token_mean`` by default, verl's default too):

    vf = 0.5 * (sum over rows i of w_i * sum_t max(...)[i,t] * m[i,t]) / N

with the row weights and partial normalizers of :mod:`.plan`. The row weights enter
as a weighted mask (verl sums the per-token loss times its mask), so the loss is
verl's own, term for term. The round is the same on every rank, before any
backward: a NaN or inf return or old value at an active token is named on the
rank that holds it, with its rows as the trainer dispatched them whatever
``critic.shuffle`` did (peers abort naming that rank), and a mini-batch with no
active token raises :class:`~lossreduce.errors.EmptyNormalizerError` everywhere
or, with ``on_empty_step='skip'``, trains nothing anywhere.

The trainer mode builds the critic's worker group from this class and hands every
rank the launch's settings (:meth:`LossReduceCriticWorker.use_reduction`) before
its first mini-batch.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.trainer.ppo.core_algos import compute_value_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.torch_functional import masked_mean
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import no_padding_2_padding

from lossreduce.trainer_worker.integrations.verl.launch import reduction_settings
from lossreduce.trainer_worker.integrations.verl.loss import (
    ROW_WEIGHT_KEY,
    StepNormalizers,
    padded,
)
from lossreduce.trainer_worker.integrations.verl.options import critic_problems, raise_problems
from lossreduce.trainer_worker.integrations.verl.plan import (
    VALUE_TERM,
    MiniBatchPlan,
    dispatched_bad_inputs,
    plan_mini_batch,
)
from lossreduce.trainer_worker.integrations.verl.worker_base import (
    ReducingTrainingWorker,
    RunClaim,
    round_metrics,
)
from lossreduce.trainer_worker.policy_gradient import zero_masked

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["LossReduceCriticWorker", "critic_micro_batch_loss"]


def critic_micro_batch_loss(
    normalizers: StepNormalizers,
    config: Any,
    model_output: dict[str, Any],
    data: Any,
    dp_group: Any = None,
) -> tuple[Tensor, dict[str, Any]]:
    """``(loss, metrics)`` of one critic micro-batch: its share of the mini-batch's value
    loss, divided by the term's global normalizer (times the data-parallel size, which
    FSDP's gradient average divides again)."""
    del dp_group  # the normalizer is already global
    vpreds = no_padding_2_padding(model_output["values"], data)  # [b, R]
    mask = padded(data["response_mask"]).bool()  # [b, R]
    dtype = torch.promote_types(vpreds.dtype, torch.float32)
    rows = data[ROW_WEIGHT_KEY].to(dtype)  # [b]
    weights = torch.where(mask, rows[:, None], 0.0)  # [b, R]: w_i at active tokens
    values = zero_masked(padded(data["values"]).to(dtype), mask)
    returns = zero_masked(padded(data["returns"]).to(dtype), mask)
    vf_sum, _ = compute_value_loss(
        vpreds=vpreds,
        returns=returns,
        values=values,
        response_mask=weights,
        cliprange_value=config.cliprange_value,
        loss_agg_mode="token-sum",
    )
    loss = vf_sum * (float(data["dp_size"]) / normalizers.of(VALUE_TERM))
    with torch.no_grad():
        # The clip fraction over the active tokens, as verl reports it (unweighted).
        _, clipfrac = compute_value_loss(
            vpreds=vpreds,
            returns=returns,
            values=values,
            response_mask=mask,
            cliprange_value=config.cliprange_value,
            loss_agg_mode="token-sum",
        )
    metrics = {
        "critic/vf_loss": Metric(value=loss, aggregation=AggregationType.SUM),
        "critic/vf_clipfrac": clipfrac.detach().item(),
        "critic/vpred_mean": masked_mean(vpreds, mask).detach().item(),
    }
    return loss, metrics


class LossReduceCriticWorker(ReducingTrainingWorker):
    """verl's critic ``TrainingWorker`` whose mini-batches are normalized by lossreduce
    (group ``critic_group``, mode ``critic_mode``)."""

    role = "critic"

    def __init__(self, config: Any, reduction: Any = None) -> None:
        super().__init__(config, reduction)
        self._critic_config: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
        """Take verl's ``partial(value_loss, config=critic_config)``; refuse anything else."""
        config = None
        if isinstance(loss_fn, functools.partial) and loss_fn.func is value_loss:
            config = loss_fn.keywords.get("config")
        if config is None:
            raise_problems(
                [f"critic loss function {loss_fn!r}: only verl's value_loss is supported"],
                self.reduction_settings,
                "critic",
            )
        raise_problems(
            critic_problems(config, self.reduction_settings), self.reduction_settings, "critic"
        )
        self._critic_config = config
        self.loss_fn = loss_fn

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def use_reduction(self, block: dict[str, Any] | None) -> None:
        """Take the launch's settings (its ``actor_rollout_ref.lossreduce`` block, over
        ``LOSSREDUCE_*``) in place of those read at start-up, before the first round."""
        if self.rounds.started:
            raise_problems(
                ["use_reduction after the first round: the rounds' names would change"],
                self.reduction_settings,
                "critic",
            )
        self.use_settings(reduction_settings(block))
        if self._critic_config is not None:
            raise_problems(
                critic_problems(self._critic_config, self.reduction_settings),
                self.reduction_settings,
                "critic",
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def claim_rounds(self) -> RunClaim:
        """:meth:`claim` on every rank (the trainer mode calls it with the actor's)."""
        return self.claim()

    @contextmanager
    def _normalized_loss(self, normalizers: StepNormalizers) -> Iterator[None]:
        stock = self.loss_fn
        self.loss_fn = functools.partial(critic_micro_batch_loss, normalizers, self._critic_config)
        try:
            yield
        finally:
            self.loss_fn = stock

    def plan(self, data: Any) -> tuple[MiniBatchPlan, list[str]]:
        """This rank's plan for the critic mini-batch ``data`` and its bad inputs."""
        mask = padded(data["response_mask"]).bool()  # [B, R]
        reduction = self.reduction_settings.critic_reduction
        rank = self.data_parallel()[0]
        rows, index = self.step_rows(data, mask, reduction.mode)
        plan = plan_mini_batch(
            reduction,
            rows,
            index,
            kl=False,
            entropy=False,
            main_term=VALUE_TERM,
        )
        inputs = {name: padded(data[name]).cpu() for name in ("returns", "values")}
        return plan, dispatched_bad_inputs(mask.cpu(), inputs, rank, *self.dispatched_rows(data))

    @register(  # type: ignore[untyped-decorator]
        dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False
    )
    def train_batch(self, data: Any) -> Any:
        """One critic mini-batch (one optimizer step) normalized by lossreduce."""
        if self._critic_config is None:
            raise_problems(
                ["no loss function: call set_loss_fn(value_loss) first"],
                self.reduction_settings,
                "critic",
            )
        step = self.next_round()
        plan, bad = self.plan(data)
        started = time.perf_counter()
        totals = self.reduce(step, plan.partials, plan.contracts, bad, VALUE_TERM)
        latency = time.perf_counter() - started
        self.last_normalizers = totals
        if totals is None:
            return self.skipped(data)
        data[ROW_WEIGHT_KEY] = plan.weights.to(torch.float32)
        with self._normalized_loss(StepNormalizers(totals)):
            output = super().train_batch(data)
        if output is not None:
            tu.get(output, "metrics").update(round_metrics(step, totals, latency, skipped=False))
        return output
