"""The ``lossreduce`` trainer mode of verl, loaded as a verl plugin.

verl imports every ``verl.plugins`` entry point in every process when ``verl``
is imported (``VERL_USE_EXTERNAL_PLUGINS``, default ``auto``); lossreduce's
entry point names this module, which registers the trainer mode
``lossreduce``: verl's synchronous PPO trainer (``sync``) whose actor workers
are :class:`~lossreduce.trainer_worker.integrations.verl.LossReduceActorRolloutRefWorker`.
A launch selects it with ``trainer.v1.trainer_mode=lossreduce``; without the
entry point (e.g. lossreduce not installed as a package)
``VERL_USE_EXTERNAL_MODULES=lossreduce.trainer_worker.integrations.verl.plugin``
loads it the same way.

Before each actor update it tells the actor's ranks whether the trainer recomputed
``old_log_prob`` with the actor for it (every step but in rollout correction's bypass
mode, where ``old_log_prob`` is the rollout's): the first mini-batch's statistics then
reuse it instead of a forward (:meth:`LossReducePPOTrainer._update_actor`).

At the end of verl's set-up, once the trainer has loaded its checkpoint (or found
none) and before its first rollout, the trainer mode has every actor rank claim its
job and group from the round the run sends first, so a launch another run's claim
refuses stops at start-up (:meth:`LossReducePPOTrainer._load_checkpoint`).

It also wraps verl's ``validate_config`` (which ``main_ppo`` calls in the driver,
before Ray starts) with :func:`~.launch.check_launch`: a launch that gives
lossreduce's settings to a trainer that would not run them stops there.
"""

from __future__ import annotations

from typing import Any

import ray
import verl.utils.config as verl_config
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from lossreduce.trainer_worker.integrations.verl.critic import LossReduceCriticWorker
from lossreduce.trainer_worker.integrations.verl.launch import (
    SETTINGS_KEY,
    TRAINER_MODE,
    check_launch,
)
from lossreduce.trainer_worker.integrations.verl.worker import (
    OLD_LOG_PROBS_CURRENT_KEY,
    LossReduceActorRolloutRefWorker,
    RunClaim,
    describe_claims,
)

__all__ = ["TRAINER_MODE", "LossReducePPOTrainer", "actor_worker_mapping", "validate_config"]

_verl_validate_config = getattr(
    verl_config.validate_config, "__wrapped__", verl_config.validate_config
)


def validate_config(config: Any, use_reference_policy: bool, use_critic: bool) -> None:
    """verl's ``validate_config``, after :func:`~.launch.check_launch`."""
    check_launch(config, use_critic)
    _verl_validate_config(config, use_reference_policy, use_critic)


# main_ppo imports validate_config by name after `import verl` has loaded this
# plugin, so it binds the wrapped one. __wrapped__ keeps a second load idempotent.
validate_config.__wrapped__ = _verl_validate_config  # type: ignore[attr-defined]
verl_config.validate_config = validate_config


def actor_worker_mapping(mapping: dict[object, object]) -> dict[object, object]:
    """``mapping`` (role -> Ray actor class) with every ``ActorRolloutRefWorker`` role
    that trains the actor built from lossreduce's worker instead, and the critic's
    ``TrainingWorker`` (PPO with a critic) from :class:`LossReduceCriticWorker`."""
    swapped = dict(mapping)
    for role, remote in mapping.items():
        name = str(role)
        cls = getattr(remote, "__ray_actor_class__", None)
        if name.startswith("actor") and cls is ActorRolloutRefWorker:
            swapped[role] = ray.remote(LossReduceActorRolloutRefWorker)
        elif name == "critic" and cls is TrainingWorker:
            swapped[role] = ray.remote(LossReduceCriticWorker)
    return swapped


@register_trainer(TRAINER_MODE)
class LossReducePPOTrainer(PPOTrainerSync):  # type: ignore[misc]
    """verl's synchronous PPO trainer with lossreduce's actor workers."""

    role_worker_mapping: dict[object, object]
    actor_rollout_wg: Any
    critic_wg: Any
    use_critic: bool
    config: Any

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        self.role_worker_mapping = actor_worker_mapping(self.role_worker_mapping)

    def _update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:
        """verl's actor update, its batch marked with whether ``old_log_prob`` is the
        actor's own of this step (:data:`~.worker.OLD_LOG_PROBS_CURRENT_KEY`): verl's
        ``_compute_old_log_prob`` recomputed it with the actor's current weights, which
        no optimizer step has changed since, unless bypass mode took the rollout's."""
        correction = self.config.algorithm.get("rollout_correction", None)
        bypass = bool(correction is not None and correction.get("bypass_mode", False))
        batch.extra_info[OLD_LOG_PROBS_CURRENT_KEY] = not bypass
        return super()._update_actor(batch, metrics)

    def _load_checkpoint(self) -> None:
        """verl's resume, then the actor's claim of its (job, group) from the round it
        sends first (:meth:`LossReduceActorRolloutRefWorker.claim_rounds`), and with a
        critic the critic's claim of its group under the same run: the end of verl's
        set-up, before any rollout. A launch whose group another run holds stops here with
        :class:`~lossreduce.errors.RunConflictError` naming the holder."""
        super()._load_checkpoint()
        claims: list[RunClaim] = self.actor_rollout_wg.claim_rounds()
        if self.use_critic:
            # verl builds the critic's ranks from the critic's own config, which has no
            # lossreduce block: they get the launch's, under the actor's run (so the same
            # job), before their first round.
            block = OmegaConf.select(self.config, SETTINGS_KEY, default=None)
            if OmegaConf.is_config(block):
                block = OmegaConf.to_container(block, resolve=True)
            self.critic_wg.use_reduction({**(block or {}), "run": claims[0].run})
            claims += self.critic_wg.claim_rounds()
        # The launch's log names the run once per group, so a refusal elsewhere can be
        # traced to it.
        for line in describe_claims(claims):
            print(line, flush=True)
