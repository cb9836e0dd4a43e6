"""SkyRL's PPO trainer with lossreduce's policy worker: the driver side of the integration.

:class:`LossReduceRayPPOTrainer` is SkyRL 0.4's ``RayPPOTrainer`` with three changes,
each at one of SkyRL's own seams:

- ``build_models`` builds the policy actor group from
  :class:`~.worker.LossReducePolicyWorker` instead of SkyRL's FSDP policy worker
  (the reference and critic workers stay SkyRL's);
- ``_normalize_advantages`` keeps SkyRL's optional z-score of the advantages
  (``algorithm.advantage_batch_normalize``) and drops the per-mini-batch division by
  SkyRL's counts (``apply_loss_reduction_to_advantages_minibatch``, clamped at 1): the
  workers divide by lossreduce's validated global normalizers instead. It also adds
  each row's prompt group (:data:`~.plan.PROMPT_FIELD`) to the batch for
  ``prompt_mean``, since SkyRL's dispatch sends each rank its rows with the whole
  batch's metadata;
- once the checkpoint is loaded (or there is none), before the first rollout, every
  policy worker claims the run's job and group
  (:meth:`~.worker.LossReducePolicyWorker.claim`) and the claims are logged.

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

from lossreduce.trainer_worker.integrations.skyrl.plan import PROMPT_FIELD, prompt_ids
from lossreduce.trainer_worker.integrations.skyrl.worker import LossReducePolicyWorker
from lossreduce.trainer_worker.integrations.worker_rounds import RunClaim, describe_claims

__all__ = ["LossReducePPOExp", "LossReduceRayPPOTrainer", "policy_worker_actor"]


def policy_worker_actor() -> Any:
    """:class:`LossReducePolicyWorker` as the Ray actor class SkyRL's actor group builds
    (one GPU each, as SkyRL's own ``PolicyWorker``)."""
    return ray.remote(num_gpus=1)(LossReducePolicyWorker)


class LossReduceRayPPOTrainer(RayPPOTrainer):  # type: ignore[misc]
    """SkyRL's synchronous PPO trainer whose policy mini-batches lossreduce normalizes."""

    claims: list[RunClaim]
    """What the policy workers claimed at start-up (one per rank)."""

    def build_models(self, PolicyWorker: Any, CriticWorker: Any, RefWorker: Any) -> None:  # noqa: N803
        """SkyRL's models, with :class:`LossReducePolicyWorker` as the policy worker."""
        del PolicyWorker  # SkyRL's FSDP worker, replaced
        super().build_models(policy_worker_actor(), CriticWorker, RefWorker)

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
        refs = self.policy_model.async_run_ray_method("pass_through", "claim")
        self.claims = list(ray.get(refs))
        for line in describe_claims(self.claims):
            logger.info(line)

    @torch.no_grad()
    def _normalize_advantages(
        self,
        data: Any,
        mini_batch_boundaries: list[tuple[int, int]],
        prompt_boundaries: list[tuple[int, int]] | None = None,
    ) -> Any:
        """SkyRL's z-score (if configured), no division, and each row's prompt group."""
        if self.cfg.trainer.algorithm.advantage_batch_normalize:
            data["advantages"] = _z_score(data["advantages"], data["response_mask"])
        boundaries = prompt_boundaries if prompt_boundaries is not None else []
        data[PROMPT_FIELD] = prompt_ids(boundaries, data.batch_size)
        return data


def _z_score(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """SkyRL's ``advantage_batch_normalize``: centred on the mean of every entry, scaled
    by the inverse standard deviation over the response tokens (at most 1e4)."""
    centred = advantages - advantages.mean()  # [B, T]
    variance = (centred.pow(2) * response_mask).sum() / response_mask.sum()
    return centred * variance.clamp(min=1e-8).rsqrt()


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
