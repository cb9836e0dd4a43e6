"""SkyRL's FSDP policy worker with lossreduce's validated global normalizers.

:class:`LossReducePolicyWorker` is SkyRL 0.4's ``FSDPPolicyWorkerBase`` with one seam
changed: ``forward_backward(data)``, which receives the rank's share of a *whole*
policy mini-batch (one optimizer step) before SkyRL splits it into micro-batches.
There, once per mini-batch and before any forward:

1. the rank plans its terms (:mod:`.plan`): the policy loss in lossreduce's mode, and
   SkyRL's KL loss and entropy bonus each as a term of its own, in ``kl_mode`` and
   ``entropy_mode`` (token means by default), counting active units only;
2. the normalizer backend sums and validates the partials over the data-parallel
   group (``device_mesh`` ``dp``: with Ulysses sequence parallelism each
   sequence-parallel index reduces in a round of its own);
3. the rank's micro-batches run SkyRL's model forward and its registered policy loss
   with the advantages scaled by each row's ``w_i / N`` (the scaling SkyRL's driver
   does with its own counts, which the trainer no longer does), and the KL and
   entropy terms as ``sum_i (w_i / N) sum_t x[i,t] m[i,t]``; the loss is multiplied by
   the data-parallel size, undoing FSDP's gradient average, as SkyRL does.

Bad input gets the same answer on every rank before any backward: a NaN or inf
advantage, log-probability or reference log-probability at an active token makes this
rank poison its partial, so it raises :class:`~lossreduce.errors.InvalidPartialError`
naming itself, the input and its rows, and its peers
:class:`~lossreduce.errors.RoundAbortedError` naming it. An empty mini-batch (no active
token on any rank) raises :class:`~lossreduce.errors.EmptyNormalizerError` on every
rank, or with ``on_empty_step='skip'`` runs no forward, backward or optimizer step:
``optim_step`` then leaves weights, optimizer state and learning-rate schedule alone
and returns no gradient norm.

:meth:`LossReducePolicyWorker.claim` claims the run's job and group at the coordinator
before the first rollout; ``save_checkpoint`` keeps the round counter next to SkyRL's
checkpoint and ``load_checkpoint`` restores it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
from skyrl.backends.skyrl_train.workers.worker_utils import (
    BaseBatchIterator,
    TokenBasedBatchIterator,
    all_reduce_metrics,
    compute_minibatch_rollout_logprob_diff_metrics,
    get_microbatch_iterator,
    reduce_metrics,
)
from skyrl.train.dataset.replay_buffer import Experience

from lossreduce.errors import UsageError
from lossreduce.trainer_worker.integrations.skyrl.plan import (
    ENTROPY_TERM,
    KL_TERM,
    POLICY_TERM,
    WEIGHT_FIELDS,
    row_scales,
    term_reductions,
    token_share,
)
from lossreduce.trainer_worker.integrations.skyrl.rounds import SkyRLRoundsMixin
from lossreduce.trainer_worker.integrations.worker_rounds import round_metrics
from lossreduce.trainer_worker.policy_gradient import zero_masked
from lossreduce.trainer_worker.step_rows import TermPlan, bad_inputs, plan_terms

__all__ = ["LossReducePolicyWorker"]

_ZEROED_INPUTS = ("advantages", "action_log_probs", "base_action_log_probs", "rollout_logprobs")
"""Per-token inputs zeroed under the loss mask before the micro-batches: a NaN at a
masked token must not reach the gradient."""


class LossReducePolicyWorker(SkyRLRoundsMixin, FSDPPolicyWorkerBase):  # type: ignore[misc]
    """SkyRL's FSDP policy worker whose mini-batches are normalized by lossreduce.

    Settings come from the trainer config's ``lossreduce`` block
    (:class:`~.config.LossReduceTrainerConfig`) over ``LOSSREDUCE_*``; the rounds, the
    claim and the round counter are :class:`~.rounds.SkyRLRoundsMixin`'s (group
    ``group``).
    """

    role = "policy"

    # -- one mini-batch -------------------------------------------------------------

    def plan(self, data: TrainingInputBatch) -> tuple[TermPlan, list[str]]:
        """This rank's plan for the mini-batch share ``data`` and its bad inputs."""
        algorithm = self.cfg.algorithm
        settings = self.reduction_settings
        reductions = term_reductions(
            settings.reduction,
            settings.kl_reduction if algorithm.use_kl_loss else None,
            settings.entropy_reduction if algorithm.use_entropy_loss else None,
        )
        mask = data["loss_mask"].cpu()  # [B, T]
        tokens = (mask != 0).sum(-1).to(torch.float64)  # [B] D_i
        rows, rank = self._rows(data, tokens, reductions)
        # The old log-probabilities are None where SkyRL skips their forward (rollout_is,
        # dppo: the loss reads the rollout's); the reference's only with the KL loss.
        wanted = {"advantages": True, "action_log_probs": True, "rollout_logprobs": True}
        wanted["base_action_log_probs"] = bool(algorithm.use_kl_loss)
        inputs = {
            name: data[name].cpu()
            for name, use in wanted.items()
            if use and data.get(name) is not None
        }
        found = bad_inputs(mask, inputs, self.mesh_rank.dp)
        return plan_terms(reductions, rows, rank), found

    def forward_backward(
        self,
        data: TrainingInputBatch,
        loss_fn: str | None = None,
        loss_fn_config: dict[str, Any] | None = None,
        return_per_token_outputs: bool = True,
    ) -> WorkerOutput:
        """One policy mini-batch share, normalized by lossreduce (see the module)."""
        if loss_fn is not None or loss_fn_config is not None:
            raise UsageError(
                f"job {self.reduction_settings.job!r}: lossreduce's policy worker trains "
                f"trainer.algorithm.policy_loss_type "
                f"({self.cfg.algorithm.policy_loss_type!r}); a per-call loss_fn "
                f"({loss_fn!r}) or loss_fn_config (SkyRL's Tinker API) is not supported"
            )
        step = self.rounds.next_step()
        plan, bad = self.plan(data)
        totals, latency = self._take_round(step, plan, bad, POLICY_TERM)
        if totals is None:
            return WorkerOutput(metrics=round_metrics(step, {}, latency, skipped=True))
        scales = row_scales(plan, totals)
        data = _normalized(data, scales)
        output = self._micro_batches(data, return_per_token_outputs)
        output.metrics.update(round_metrics(step, totals, latency, skipped=False))
        return output

    # -- the micro-batches ----------------------------------------------------------

    def _micro_batches(
        self, data: TrainingInputBatch, return_per_token_outputs: bool
    ) -> WorkerOutput:
        """SkyRL's micro-batch loop (its iterator, metric reduction and output order)
        around :meth:`_micro_step`."""
        iterator = get_microbatch_iterator(
            data,
            micro_batch_size=self.cfg.micro_train_batch_size_per_gpu,
            max_tokens_per_microbatch=self.cfg.max_tokens_per_microbatch,
        )
        metrics: dict[str, list[float]] = defaultdict(list)
        outputs: list[list[dict[str, Any]]] = []
        for micro_batch in iterator:
            # A padding micro-batch of the token-based iterator carries none of the
            # fields the worker added: it weighs nothing.
            n = len(micro_batch)
            scales = {
                term: micro_batch.get(field, torch.zeros(n, dtype=torch.float64))
                for term, field in WEIGHT_FIELDS.items()
            }
            experience = BaseBatchIterator.batch_to_experience(micro_batch)
            status = self._micro_step(experience, scales, return_per_token_outputs)
            outputs.append(status.pop("loss_fn_outputs"))
            for key, value in status.items():
                metrics[key].append(value)
        if not return_per_token_outputs or not any(outputs):
            ordered: list[dict[str, Any]] = []
        elif isinstance(iterator, TokenBasedBatchIterator):
            ordered = iterator.reorder_and_combine_items(outputs)
        else:
            ordered = [item for batch in outputs for item in batch]
        result = reduce_metrics(metrics, sum_loss_metrics=True)
        if self.cfg.max_tokens_per_microbatch > 0:
            result["num_microbatches"] = float(len(iterator))
            result["num_padding_microbatches"] = float(iterator.num_padding_microbatches)
        dp_group = self.device_mesh.get_group("dp")
        result = all_reduce_metrics(result, self.strategy, group=dp_group, sum_loss_metrics=True)
        return WorkerOutput(loss_fn_outputs=ordered, metrics=result)

    def _micro_step(
        self,
        experience: Experience,
        scales: dict[str, torch.Tensor],
        return_per_token_outputs: bool,
    ) -> dict[str, Any]:
        """Forward, the terms' shares and backward of one micro-batch."""
        self.model.train()
        experience.to_device(torch.cuda.current_device())
        algorithm = self.cfg.algorithm
        mask = experience.loss_mask  # [B, T]
        replay = algorithm.enable_sample_support_replay
        # SkyRL's own autocast (a no-op for its FSDP model, which casts itself).
        with torch.autocast(
            dtype=torch.bfloat16, device_type="cuda", enabled=torch.cuda.is_available()
        ):
            log_probs, output = self.model(
                experience.sequences,
                experience.num_actions,
                attention_mask=experience.attention_mask,
                temperature=algorithm.temperature,
                return_output=True,
                compute_entropy=True,
                entropy_requires_grad=algorithm.use_entropy_loss,
                pixel_values=experience.pixel_values,
                image_grid_thw=experience.image_grid_thw,
                sample_support=experience.rollout_sample_support if replay else None,
                loss_mask=mask if replay else None,
                enable_sample_support_replay=replay,
            )  # log_probs: [B, T]
            policy_loss, loss_metrics = self.policy_loss_fn(
                log_probs,
                experience.action_log_probs,
                experience.advantages,
                config=algorithm,
                loss_mask=mask,
                rollout_logprobs=experience.rollout_logprobs,
            )
        n = experience.num_actions
        entropy = output["entropy"][:, -n - 1 : -1]  # [B, T]: predicts the response tokens
        loss = policy_loss
        status: dict[str, Any] = {}
        if algorithm.use_kl_loss:
            kl = compute_approx_kl(
                log_probs,
                experience.base_action_log_probs,
                loss_mask=mask,
                kl_estimator_type=algorithm.kl_estimator_type,
            )  # [B, T]
            kl_share = token_share(kl, mask, scales[KL_TERM])
            loss = loss + algorithm.kl_loss_coef * kl_share
            status["lossreduce/kl_loss"] = kl_share.item()
            status["policy_kl"] = masked_mean(kl, mask, dim=-1).mean().item()
        if algorithm.use_entropy_loss:
            entropy_share = token_share(entropy, mask, scales[ENTROPY_TERM])
            loss = loss - algorithm.entropy_loss_coef * entropy_share
            status["lossreduce/entropy_loss"] = entropy_share.item()
        # FSDP averages gradients over the data-parallel ranks; the shares are sums.
        self.strategy.backward(loss * self.mesh_rank.dp_size, self.model, self.optimizer)
        with torch.no_grad():
            status["policy_entropy"] = masked_mean(zero_masked(entropy, mask), mask).item()
        status.update(
            {
                "final_loss": loss.item(),
                "policy_loss": policy_loss.item(),
                "response_length": n,
                "policy_lr": self.scheduler.get_last_lr()[0],
                "loss_fn_outputs": _log_prob_outputs(experience, log_probs)
                if return_per_token_outputs
                else [],
            }
        )
        status.update({f"loss_metrics/{k}": v for k, v in loss_metrics.items()})
        status.update(
            compute_minibatch_rollout_logprob_diff_metrics(
                log_probs, experience.rollout_logprobs, mask
            )
        )
        return status


def _normalized(data: TrainingInputBatch, scales: dict[str, torch.Tensor]) -> TrainingInputBatch:
    """``data`` with the inputs zeroed under the loss mask, the advantages scaled by each
    row's policy ``w_i / N`` and the other terms' scales as fields of their own."""
    out = TrainingInputBatch(dict(data))
    out.metadata = data.metadata
    mask = data["loss_mask"]
    for name in _ZEROED_INPUTS:
        if data.get(name) is not None:
            out[name] = zero_masked(data[name], mask)
    pg = scales[POLICY_TERM].to(data["advantages"].dtype)  # [B]
    out["advantages"] = out["advantages"] * pg[:, None]
    for term, field in WEIGHT_FIELDS.items():
        if term in scales:
            out[field] = scales[term]
    return out


def _log_prob_outputs(experience: Experience, log_probs: torch.Tensor) -> list[dict[str, Any]]:
    """Per row, the log-probabilities of its response tokens (what SkyRL returns)."""
    reference = (
        experience.response_mask
        if experience.response_mask is not None
        else (experience.loss_mask != 0)
    )
    lengths = reference.sum(-1).int().tolist()
    rows = log_probs.detach().cpu()
    return [{"logprobs": rows[i, -n:].tolist() if n > 0 else []} for i, n in enumerate(lengths)]
