"""AReaL's ``PPOTrainer`` whose actor is a LossReduce actor: the one launch-script change.

``RLTrainer._create_train_engine`` hard-codes AReaL's three actor classes and
has no configuration hook, so this trainer overrides it for the actor only
(the reference model and a teacher never train, and keep AReaL's classes).
"""

from __future__ import annotations

from typing import Any

from areal.trainer.rl_trainer import PPOTrainer
from areal.utils.environ import is_single_controller

from lossreduce.errors import LossReduceError, ReductionConfigError
from lossreduce.trainer_worker.integrations.areal.actor import refuse_unsupported
from lossreduce.trainer_worker.integrations.areal.actors import (
    areal_actor_class,
    lossreduce_actor,
)
from lossreduce.trainer_worker.integrations.areal.settings import ArealReductionSettings
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode

__all__ = ["LossReducePPOTrainer"]


class LossReducePPOTrainer(PPOTrainer):  # type: ignore[misc]
    """``PPOTrainer(config, train_dataset, valid_dataset, ...)`` plus ``reduction``
    (default: :class:`ArealReductionSettings` from the ``LOSSREDUCE_*`` environment).

    In single-controller mode the workers build the actor themselves and read
    the settings from their own environment, so pass them as ``LOSSREDUCE_*``
    variables there rather than as ``reduction``.

    Once AReaL's init (its recovery included) is done, the trainer claims the
    actor's (job, group) with the coordinator, so a launch another run holds the
    job against fails here with ``RunConflictError``, before any rollout.
    """

    def __init__(
        self,
        config: Any,
        train_dataset: Any = None,
        valid_dataset: Any = None,
        *,
        reduction: ArealReductionSettings | None = None,
    ) -> None:
        if reduction is not None and is_single_controller():
            # The controller's workers build the actor from their own environment: a
            # ``reduction`` given here would never reach them, and they would train with
            # whatever LOSSREDUCE_* they have (token_mean by default), silently.
            raise ReductionConfigError(
                f"LossReducePPOTrainer (job {reduction.job!r}): reduction= is set, but this "
                "is AReaL's single-controller mode (AREAL_SPMD_MODE is not set), where the "
                "workers read their settings from LOSSREDUCE_* in the environment the "
                "scheduler gives them; set those variables (in the controller's environment "
                "or the actor's scheduling_spec env_vars) instead of reduction=",
                job=reduction.job,
                group=reduction.group,
            )
        # Before AReaL's init starts its scheduler, rollout and engines: a bad LOSSREDUCE_*
        # variable is one line naming it, in seconds.
        self.reduction_settings = (
            reduction
            if reduction is not None
            else validate_settings(
                ArealReductionSettings, what="LossReducePPOTrainer's reduction settings"
            )
        )
        settings = self.reduction_settings
        refuse_unsupported(config.actor, settings)
        if (
            getattr(config, "teacher", None) is not None
            and settings.mode is not PolicyGradientMode.TOKEN_MEAN
        ):
            raise ReductionConfigError(
                f"LossReducePPOTrainer (job {settings.job!r}): teacher is set, and AReaL adds "
                f"the distillation penalty into the policy-gradient loss before dividing, so "
                f"mode {settings.mode.value!r} would normalize it per response or prompt; use "
                "mode 'token_mean' with a teacher",
                job=settings.job,
                group=settings.group,
            )
        super().__init__(config, train_dataset, valid_dataset)
        self._claim_rounds()

    def _claim_rounds(self) -> None:
        """Claim the actor's (job, group) now that AReaL's recovery has restored the
        weight version, before the first rollout: a launch the coordinator refuses
        (another run holds the job) stops here, not after a rollout at its first round.

        In single-controller mode the actor lives in AReaL's workers, which claim at
        their first round instead.
        """
        if is_single_controller():
            return
        try:
            self.actor.claim_rounds()
        except LossReduceError:
            # The caller never gets this trainer to close: shut down the rollout and
            # engines AReaL's init started, as the trainer's `with` block would.
            self.close()
            raise

    def _create_train_engine(self, actor_config: Any, alloc: Any) -> Any:
        if actor_config is not self.config.actor:
            return super()._create_train_engine(actor_config, alloc)
        # Build AReaL's choice of class for this backend, then its LossReduce version.
        stock: Any = areal_actor_class(alloc.backend)
        actor_cls = lossreduce_actor(stock)
        if is_single_controller():
            actor = actor_cls.as_controller(actor_config, self.scheduler)
        else:
            actor = actor_cls(config=actor_config, reduction=self.reduction_settings)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor
