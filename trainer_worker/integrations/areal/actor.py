"""AReaL PPO actors whose update is normalized by lossreduce.

AReaL's ``PPOActor`` calls ``engine.train_batch(batch, loss_fn, loss_weight_fn)``
once per optimizer step. :class:`LossReduceActorMixin`, placed before an AReaL
actor class (``FSDPPPOActor``; ``MegatronPPOActor`` and ``ArchonPPOActor``
through :func:`lossreduce_actor`), intercepts that call:

1. Before any forward it plans the step (:mod:`.plan`): one partial per term
   and the weight ``w_i`` of every row, and the problems of this rank's
   inputs. The normalizer backend (torch.distributed over the engine's
   data-parallel group, or the coordinator) sums and validates the partials
   in float64; an invalid partial, a NaN loss input or an empty step raises
   the same way on every rank, before any backward. A rank with bad inputs
   still takes part in the round with NaN partials, so its peers abort at
   once (RoundAbortedError naming it) while it raises InvalidPartialError
   naming its inputs.
2. It then calls the engine's own ``train_batch`` with the weights attached
   to the batch as :data:`~.plan.WEIGHT_KEY`, a loss function that wraps
   AReaL's and a weight function that counts each micro-batch's sequences.

AReaL's loss for a micro-batch ``b`` is ``sum_t l_t / n_b`` (its own token
count ``n_b``) and the engine scales it by ``r_b / R * k``, where ``r_b`` is
now the micro-batch's sequences, ``R`` their sum over the ranks (exact in
float32 below 2^24; the ``rows`` term gives it exactly) and ``k`` the engine's
multiplier that its gradient averaging undoes. The wrapper leaves the forward
value of AReaL's loss untouched (so every statistic AReaL logs is its own) and
multiplies the gradient reaching each token's log-probability by
``w_i / N_pg * n_b * R / r_b``, so the step's gradient is that of
``sum_i w_i * sum_t l[i,t] * m[i,t] / N_pg``. That is exact for AReaL's
token-level losses (PPO, SAPO, decoupled PPO, rejection sampling) and for
GSPO's sequence-level ratio, because every token of a response has the same
weight.

M2PO (``actor.m2_threshold``) is not a loss AReaL can weigh this way: its loss
masks each micro-batch on its own and divides by the tokens it kept, while
``n_b`` counts them before the mask, which leaves a factor ``n_b / kept`` in
every micro-batch, and which tokens it keeps depends on the split. With
``m2po='global'`` (the default) the mask is decided first, over the whole step
on every rank (:mod:`.m2po`), applied to the loss mask, and AReaL's own is
turned off, so ``n_b`` is the kept count and the above is exact again;
``m2po='local'`` keeps AReaL's per-micro-batch mask with both effects.

Terms. AReaL 1.0.4 puts the KL penalty into the reward (``kl_ctl``), so it
reaches the loss through the advantages and has no normalizer of its own, and
it computes no entropy loss (the entropy is logged, detached). The one further
loss term is the teacher distillation penalty (a batch with ``teacher_logp``),
a token mean: it is its own ``distill`` term, and is refused in any mode but
``token_mean`` because AReaL adds it into the policy-gradient loss before the
division.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from areal.utils.data import concat_batch
from torch import Tensor

from lossreduce.errors import ReductionConfigError, ReductionInputError
from lossreduce.trainer_worker.integrations.areal.m2po import GROUP_SUFFIX as M2PO_GROUP_SUFFIX
from lossreduce.trainer_worker.integrations.areal.m2po import (
    RoundPlace,
    global_mask,
    m2po_config_problems,
)
from lossreduce.trainer_worker.integrations.areal.plan import (
    DISTILL_TERM,
    GROUP_KEY,
    POLICY_TERM,
    ROW_KEY,
    ROWS_TERM,
    WEIGHT_KEY,
    BatchPlan,
    plan_batch,
    token_weights,
)
from lossreduce.trainer_worker.integrations.areal.settings import ArealReductionSettings
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.integrations.worker_rounds import DataParallel, WorkerRounds
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode, PolicyGradientReduction

__all__ = ["LossReduceActorMixin", "refuse_unsupported"]

LossFn = Callable[..., Tensor]
WeightFn = Callable[[dict[str, Any]], Tensor]

_EXACT_ROWS = 2**24
"""The engine sums the micro-batch weights in float32: sequence counts are exact below this."""

ROUNDS_PER_VERSION = 1024
"""Round steps reserved for each AReaL weight version: a version's PPO update makes
``ppo_n_minibatches`` rounds, so the rounds of version ``v`` start at ``v * 1024`` and
a run resumed at version ``v`` continues after the rounds of every earlier version."""


def refuse_unsupported(config: Any, settings: ArealReductionSettings) -> None:
    """Raise :class:`ReductionConfigError` naming every AReaL option (of a
    ``PPOActorConfig``) that the actor could not honour exactly."""
    problems = []
    if getattr(config, "is_critic", False):
        problems.append("is_critic=True: the LossReduce actors normalize an actor's PPO loss")
    if getattr(config, "enable_tree_training", False):
        problems.append(
            "enable_tree_training=True: tree-packed micro-batches share prefix tokens between "
            "responses, so a token has no single response weight (AReaL #1546 refuses tree "
            "training with a non-token mode for the same reason)"
        )
    problems += m2po_config_problems(config, settings.m2po)
    if problems:
        raise ReductionConfigError(
            f"LossReduce actor (job {settings.job!r}, mode {settings.mode.value!r}) cannot "
            f"honour: {'; '.join(problems)}",
            job=settings.job,
            group=settings.group,
        )


def _rows(mb: Mapping[str, Any]) -> int:
    """Sequences in a packed micro-batch (AReaL packs with ``cu_seqlens`` [rows + 1])."""
    cu_seqlens = mb.get("cu_seqlens")
    if not isinstance(cu_seqlens, Tensor):
        raise ReductionInputError(
            f"a packed micro-batch needs cu_seqlens; this one holds {sorted(mb)}"
        )
    return int(cu_seqlens.numel()) - 1


def _rows_weight(mb: dict[str, Any]) -> Tensor:
    """The engine's per-micro-batch weight: its sequence count (exact in float32)."""
    cu_seqlens = mb["cu_seqlens"]
    return torch.tensor(float(_rows(mb)), dtype=torch.float32, device=cu_seqlens.device)


def _gradient_scaled(values: Tensor, scale: Tensor) -> Tensor:
    """``values`` exactly, but the gradient through it multiplied by ``scale``.

    ``values - frozen`` is exactly 0 in the forward, so the sum is ``values``
    bit for bit while its derivative is ``scale``.
    """
    frozen = values.detach()
    return frozen + (values - frozen) * scale


def weighted_loss(loss_fn: LossFn, loss_weight_fn: WeightFn, engine_rows: float) -> LossFn:
    """AReaL's ``loss_fn`` with each token's gradient weighted (see the module docstring).

    ``engine_rows`` is the engine's own sum of :func:`_rows_weight` over its
    weight group (``R``).
    """

    def loss(
        logprobs: Tensor,
        entropy: Tensor,
        mb_input: dict[str, Any],
        vocab_min_logits: Tensor | None = None,
        vocab_max_logits: Tensor | None = None,
    ) -> Tensor:
        weights = mb_input[WEIGHT_KEY]  # [tokens] float64, packed like logprobs
        if weights.shape != logprobs.shape:
            raise ReductionInputError(
                f"the micro-batch's token weights have shape {tuple(weights.shape)} but its "
                f"log-probabilities {tuple(logprobs.shape)}; this engine layout is not supported"
            )
        # AReaL's loss divides by its own token count, `or 1` when there is none.
        own = max(float(loss_weight_fn(mb_input)), 1.0)
        scale = weights * (own * engine_rows / _rows(mb_input))  # [tokens] float64
        return loss_fn(
            _gradient_scaled(logprobs, scale.to(logprobs.dtype)),
            entropy,
            mb_input,
            vocab_min_logits=vocab_min_logits,
            vocab_max_logits=vocab_max_logits,
        )

    return loss


def _with_groups(data: Any) -> Any:
    """``ppo_update``'s trajectory dicts, each numbered as its own prompt group, and each
    row by its place in their concatenation (``ROW_KEY``: AReaL splits the concatenated
    batch into optimizer steps out of order, and a bad input names its row by it)."""
    if not isinstance(data, list):
        return data
    tagged = []
    offset = 0
    for index, item in enumerate(data):
        mask = item.get("attention_mask") if isinstance(item, dict) else None
        if not isinstance(mask, Tensor):
            tagged.append(item)
            continue
        b = int(mask.shape[0])
        added: dict[str, Tensor] = {}
        if GROUP_KEY not in item:
            added[GROUP_KEY] = torch.full(
                mask.shape, index, dtype=torch.int64, device=mask.device
            )  # [b, T]
        if ROW_KEY not in item:
            rows = torch.arange(offset, offset + b, dtype=torch.int64, device=mask.device)
            added[ROW_KEY] = rows[:, None].expand(mask.shape).contiguous()  # [b, T]
        offset += b
        tagged.append({**item, **added})
    return tagged


class LossReduceActorMixin:
    """Place before an AReaL PPO actor class: its PPO update uses lossreduce's reduction.

    ``reduction`` defaults to :class:`ArealReductionSettings` read from the
    ``LOSSREDUCE_*`` environment. ``skipped_steps`` counts optimizer steps
    skipped as empty (``on_empty_step='skip'``). :attr:`rounds` holds the run, its
    claim, the normalizer backends and the round counter; ``destroy`` closes its
    coordinator clients.
    """

    # What the AReaL engine provides (FSDPEngine, MegatronEngine, ArchonEngine).
    config: Any

    def __init__(self, config: Any, *, reduction: ArealReductionSettings | None = None) -> None:
        settings = (
            reduction
            if reduction is not None
            else validate_settings(
                ArealReductionSettings, what="the AReaL actor's reduction settings"
            )
        )
        refuse_unsupported(config, settings)
        super().__init__(config)  # type: ignore[call-arg]
        self.reduction_settings = settings
        self.policy_reduction: PolicyGradientReduction = settings.reduction
        self.skipped_steps = 0
        # The run id is drawn at the first step, when every rank of the actor trains: rank
        # 0's draw is shared from the engine's device (NCCL needs a CUDA tensor).
        self.rounds = WorkerRounds(
            settings, self._data_parallel, device=lambda: self._device(torch.device("cpu"))
        )
        """This rank's rounds: the run, the claim, the backends, the round counter."""

    # -- AReaL's entry points ------------------------------------------------------

    def ppo_update(self, data: Any) -> None:
        """AReaL's ``ppo_update``, with each trajectory dict numbered as a prompt group and
        each row by its place (:func:`_with_groups`)."""
        super().ppo_update(_with_groups(data))  # type: ignore[misc]

    def train_batch(
        self,
        input_: list[dict[str, Any]] | dict[str, Any],
        loss_fn: LossFn,
        loss_weight_fn: WeightFn,
    ) -> dict[str, float]:
        """One optimizer step with lossreduce's normalizers (see the module docstring)."""
        batch = self._one_batch(input_)
        step = self._round_step()
        settings = self.reduction_settings
        job = self.rounds.job
        if (
            "teacher_logp" in batch
            and self.policy_reduction.mode is not PolicyGradientMode.TOKEN_MEAN
        ):
            # The same on every rank: a teacher is configured for the whole run.
            raise ReductionConfigError(
                f"job {job!r} step {step}: AReaL adds the teacher distillation "
                f"penalty into the policy-gradient loss before dividing, so it would be "
                f"normalized per {self.policy_reduction.mode.value} unit; with a teacher use "
                "mode 'token_mean'",
                job=job,
                group=settings.group,
                step=step,
            )
        m2po = (
            global_mask(
                batch, loss_fn, getattr(self.config, "m2_threshold", None), self.m2po_place, step
            )
            if settings.m2po == "global"
            else None
        )
        m2po_stats = {} if m2po is None else m2po.stats()
        if m2po is not None:
            # The loss mask without the dropped tokens: the normalizers, AReaL's
            # weights and its per-micro-batch counts all count the kept tokens.
            batch, loss_fn = m2po.batch, m2po.loss_fn
        token_weight = float(loss_weight_fn(batch))
        plan = plan_batch(self.policy_reduction, batch, token_weight)
        normalizers = self._reduce(step, plan, batch["loss_mask"].device)
        if normalizers is None:
            self.skipped_steps += 1
            # No forward, backward or optimizer step: weights and optimizer state untouched.
            return {"update_successful": 0.0, "lossreduce/skipped": 1.0, **m2po_stats}
        engine_rows = normalizers[ROWS_TERM] * self._weight_group_factor()
        if engine_rows >= _EXACT_ROWS:
            raise ReductionConfigError(
                f"job {job!r} step {step}: {engine_rows:.0f} sequences in one step; "
                f"the engine sums its weights in float32, exact only below {_EXACT_ROWS}",
                job=job,
                group=settings.group,
                step=step,
            )
        weighted = {**batch, WEIGHT_KEY: token_weights(plan, normalizers, batch["loss_mask"])}
        stats: dict[str, float] = super().train_batch(  # type: ignore[misc]
            weighted, weighted_loss(loss_fn, loss_weight_fn, engine_rows), _rows_weight
        )
        stats["lossreduce/skipped"] = 0.0
        stats.update(m2po_stats)
        for term in (POLICY_TERM, DISTILL_TERM):
            if term in normalizers:
                stats[f"lossreduce/normalizer/{term}"] = normalizers[term]
        return stats

    def claim_rounds(self) -> bool:
        """Claim this run's (job, group) at the step its next round will carry, before
        any rollout: a launch that another run holds the job against raises
        :class:`~lossreduce.errors.RunConflictError` (naming the holder) here. A no-op
        with the torch backend. True when this run took the claim over (a run resumed
        past every round of the holder)."""
        self._follow_version()
        return self.rounds.claim().took_over

    def _follow_version(self) -> None:
        """Number the next round within AReaL's weight version (which its trainer sets
        from the global step, and a recovered run restores), never below the last."""
        get_version = getattr(self, "get_version", None)
        version = int(get_version()) if get_version is not None else 0
        self.rounds.advance_to(version * ROUNDS_PER_VERSION)

    def _round_step(self) -> int:
        """The next round's step (see :meth:`_follow_version`), now taken."""
        self._follow_version()
        return self.rounds.next_step()

    def destroy(self) -> None:
        """AReaL's ``destroy``, closing the coordinator clients first."""
        self.rounds.close()
        super().destroy()  # type: ignore[misc]

    @staticmethod
    def _one_batch(input_: list[dict[str, Any]] | dict[str, Any]) -> dict[str, Any]:
        """The step's padded batch (AReaL concatenates a list of trajectory dicts)."""
        if isinstance(input_, list):
            batch: dict[str, Any] = concat_batch(input_)[0]
            return batch
        return input_

    # -- the ranks and their rounds ------------------------------------------------

    def _data_parallel(self) -> DataParallel:
        """The ranks the partials are summed over: the engine's data-parallel group."""
        engine: Any = self
        group = engine.data_parallel_group
        return DataParallel(
            group=group,
            rank=dist.get_rank(group),
            size=dist.get_world_size(group),
            round_group=self._reduction_group(),
        )

    def _reduction_group(self) -> str:
        """This rank's reduction group: one per model-parallel index (they hold the same data)."""
        engine: Any = self
        group = self.reduction_settings.group
        model_parallel = engine.context_and_model_parallel_group
        if dist.get_world_size(model_parallel) > 1:
            group = f"{group}.mp{dist.get_rank(model_parallel)}"
        return group

    def _weight_group_factor(self) -> int:
        """How many ranks of the engine's weight group hold each data-parallel rank's data.

        1 for FSDP and Archon (their weights are summed over data parallelism);
        Megatron sums them over data and context parallelism, where every
        context-parallel rank counts the whole sequences.
        """
        if not any(cls.__name__ == "MegatronEngine" for cls in type(self).__mro__):
            return 1
        strategy = getattr(self, "parallel_strategy", None)
        return int(getattr(strategy, "context_parallel_size", 1))

    def m2po_place(self) -> RoundPlace:
        """Where the global M2PO cut-off's rounds go: a backend of their own, in
        ``<group>.m2po`` (made on first use)."""
        dp = self.rounds.dp
        return RoundPlace(
            self.rounds.normalizer(M2PO_GROUP_SUFFIX),
            dp.rank,
            dp.size,
            self.rounds.job,
            self.rounds.group(M2PO_GROUP_SUFFIX),
        )

    def _device(self, fallback: torch.device) -> torch.device:
        device = getattr(self, "device", None)
        return device if isinstance(device, torch.device) else fallback

    def _reduce(self, step: int, plan: BatchPlan, device: torch.device) -> dict[str, float] | None:
        """The step's round (:meth:`WorkerRounds.reduce`): its validated normalizers, None
        for a skipped empty step, or its error, the same on every rank. A rank with bad
        inputs sends every partial as NaN (one already invalid, a bad ``loss_weight_fn``
        value, as it is, so the peers' error names that value) and raises what is wrong
        with them. One call per step: ``lossreduce train --engine areal`` times it."""
        device = self._device(device)
        partials = {
            t: torch.tensor(v, dtype=torch.float64, device=device) for t, v in plan.partials.items()
        }
        return self.rounds.reduce(
            step, partials, plan.contracts, bad=list(plan.problems), poisoned=sorted(plan.partials)
        )
