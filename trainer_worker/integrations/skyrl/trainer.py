"""SkyRL's PPO trainer with lossreduce's policy worker: the driver side of the integration.

:class:`LossReduceRayPPOTrainer` is SkyRL 0.4's ``RayPPOTrainer`` with three changes,
each at one of SkyRL's own seams:

- ``build_models`` builds the policy actor group from
  :class:`~.worker.LossReducePolicyWorker` and the critic's (with a critic model) from
  :class:`~.critic.LossReduceCriticWorker` instead of SkyRL's FSDP workers (the
  reference worker stays SkyRL's);
- ``_normalize_advantages`` keeps SkyRL's optional z-score of the advantages
  (``algorithm.advantage_batch_normalize``), its mean and deviation taken over the
  active tokens only (:func:`~.plan.z_score`), and drops the per-mini-batch division by
  SkyRL's counts (``apply_loss_reduction_to_advantages_minibatch``, clamped at 1): the
  workers divide by lossreduce's validated global normalizers instead;
- ``train_critic_and_policy`` first adds each row's prompt group
  (:data:`~.plan.PROMPT_FIELD`) to the batch for ``prompt_mean``, since SkyRL's
  dispatch sends each rank its rows with the whole batch's metadata (the critic trains
  before the policy, before ``_normalize_advantages``);
- once the checkpoint is loaded (or there is none), before the first rollout, every
  policy and critic worker claims the run's job and its group
  (:meth:`~.rounds.SkyRLRoundsMixin.claim`) and the claims are logged.

:class:`LossReducePPOExp` is SkyRL's ``BasePPOExp`` whose ``get_trainer`` returns this
trainer (SkyRL's documented way to change the trainer).
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from loguru import logger
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.trainer import RayPPOTrainer
from skyrl.train.utils.trainer_utils import ResumeMode

from lossreduce.trainer_worker.integrations.skyrl.critic import LossReduceCriticWorker
from lossreduce.trainer_worker.integrations.skyrl.plan import PROMPT_FIELD, prompt_ids, z_score
from lossreduce.trainer_worker.integrations.skyrl.worker import LossReducePolicyWorker
from lossreduce.trainer_worker.integrations.worker_rounds import RunClaim, describe_claims

__all__ = [
    "LossReducePPOExp",
    "LossReduceRayPPOTrainer",
    "critic_worker_actor",
    "policy_worker_actor",
]


def policy_worker_actor() -> Any:
    """:class:`LossReducePolicyWorker` as the Ray actor class SkyRL's actor group builds
    (one GPU each, as SkyRL's own ``PolicyWorker``)."""
    return ray.remote(num_gpus=1)(LossReducePolicyWorker)


def critic_worker_actor() -> Any:
    """:class:`LossReduceCriticWorker` as the Ray actor class SkyRL's actor group builds
    (one GPU each, as SkyRL's own ``CriticWorker``)."""
    return ray.remote(num_gpus=1)(LossReduceCriticWorker)


class LossReduceRayPPOTrainer(RayPPOTrainer):  # type: ignore[misc]
    """SkyRL's synchronous PPO trainer whose policy mini-batches lossreduce normalizes."""

    claims: list[RunClaim]
    """What the policy and critic workers claimed at start-up (one per rank)."""

    def build_models(self, PolicyWorker: Any, CriticWorker: Any, RefWorker: Any) -> None:  # noqa: N803
        """SkyRL's models, with :class:`LossReducePolicyWorker` as the policy worker and
        :class:`LossReduceCriticWorker` as the critic's."""
        del PolicyWorker, CriticWorker  # SkyRL's FSDP workers, replaced
        super().build_models(policy_worker_actor(), critic_worker_actor(), RefWorker)

    def init_weight_sync_state(self) -> None:
        """SkyRL's weight sync set-up; without a resume, the claim (round 0) follows."""
        super().init_weight_sync_state()
        if self.resume_mode == ResumeMode.NONE:
            self._claim()

    def load_checkpoints(self) -> tuple[int, str | None]:
        """SkyRL's checkpoint loading (the policy workers restore their round counter with
        it), then the claim from the restored round."""
        loaded: tuple[int, str | None] = super().load_checkpoints()
        self._claim()
        return loaded

    def _claim(self) -> None:
        groups = [self.policy_model]
        if self.critic_model is not None:
            groups.append(self.critic_model)
        refs = [r for g in groups for r in g.async_run_ray_method("pass_through", "claim")]
        self.claims = list(ray.get(refs))
        for line in describe_claims(self.claims):
            logger.info(line)

    def train_critic_and_policy(self, data: Any) -> Any:
        """SkyRL's critic and policy updates, each row's prompt group added first."""
        boundaries = data.metadata.get("policy_prompt_boundaries") or []
        data[PROMPT_FIELD] = prompt_ids(boundaries, data.batch_size)
        return super().train_critic_and_policy(data)

    @torch.no_grad()
    def _normalize_advantages(
        self,
        data: Any,
        mini_batch_boundaries: list[tuple[int, int]],
        prompt_boundaries: list[tuple[int, int]] | None = None,
    ) -> Any:
        """The z-score (if configured, over active tokens), and no division."""
        del mini_batch_boundaries, prompt_boundaries  # the workers divide, per mini-batch
        if self.cfg.trainer.algorithm.advantage_batch_normalize:
            # Over the active tokens only: a NaN under the mask must not reach them.
            data["advantages"] = z_score(data["advantages"], data["loss_mask"])
        return data


class LossReducePPOExp(BasePPOExp):  # type: ignore[misc]
    """SkyRL's experiment whose trainer is :class:`LossReduceRayPPOTrainer`."""

    def get_trainer(
        self,
        *,
        cfg: Any,
        tracker: Any,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any,
        inference_engine_client: Any,
        generator: Any,
        colocate_pg: Any,
    ) -> LossReduceRayPPOTrainer:
        """The trainer SkyRL builds, with lossreduce's policy worker."""
        return LossReduceRayPPOTrainer(
            cfg=cfg,
            tracker=tracker,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            inference_engine_client=inference_engine_client,
            generator=generator,
            colocate_pg=colocate_pg,
        )
