"""No silent fallback: a verl launch that asks for lossreduce runs lossreduce, or stops.

verl keeps its own normalization in every trainer but the ``lossreduce`` trainer
mode, and says nothing when lossreduce's settings are given to another one. So
before verl validates a launch's config (the plugin wraps verl's
``validate_config``, which ``main_ppo`` calls in the driver before Ray starts),
:func:`check_launch` refuses, naming the flag to set:

- ``trainer.v1.trainer_mode=lossreduce`` or ``actor_rollout_ref.lossreduce`` with
  ``trainer.use_v1=False`` (verl's legacy trainer, which builds its own workers);
- ``actor_rollout_ref.lossreduce`` with any other ``trainer.v1.trainer_mode``:
  ``sync`` trains verl's own actor, and verl's asynchronous modes
  (``colocate_async``, ``separate_async``) are refused by name: their actor is
  verl's, and lossreduce has no asynchronous variant of its trainer mode (tested
  with the synchronous PPO trainer only);
- a bad value in the settings themselves (the ``actor_rollout_ref.lossreduce``
  block over ``LOSSREDUCE_*``), by :func:`reduction_settings`, naming the key or
  the variable, the value and what is allowed: in seconds, where the workers
  would refuse it only after Ray, TransferQueue and the rollout started;
- an actor (or critic) option the workers would refuse (:mod:`.options`: a policy
  loss with a mode that has no meaning for it, a ``loss_agg_mode`` that would be
  silently replaced, an engine strategy), all named at once.

Reads the config through OmegaConf and imports no verl.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.integrations.verl.options import (
    actor_problems,
    critic_problems,
    engine_problems,
    raise_problems,
)
from lossreduce.trainer_worker.integrations.verl.settings import VerlReductionSettings

__all__ = [
    "ASYNC_TRAINER_MODES",
    "SETTINGS_KEY",
    "TRAINER_MODE",
    "check_launch",
    "reduction_settings",
]

TRAINER_MODE = "lossreduce"
"""The ``trainer.v1.trainer_mode`` that selects lossreduce's actor."""
SETTINGS_KEY = "actor_rollout_ref.lossreduce"
"""Where a launch gives lossreduce's settings (``+actor_rollout_ref.lossreduce.mode=...``)."""
ASYNC_TRAINER_MODES = ("colocate_async", "separate_async")
"""verl 0.9.1's asynchronous trainer modes, which lossreduce refuses by name."""


def check_launch(config: Any, use_critic: bool = False) -> None:
    """Raise :class:`ReductionConfigError` if ``config`` (verl's whole launch config) asks
    for lossreduce in a trainer that would not run it, or for options its actor (and,
    with ``use_critic``, its critic) would refuse."""
    given = OmegaConf.select(config, SETTINGS_KEY, default=None) is not None
    mode = OmegaConf.select(config, "trainer.v1.trainer_mode", default=None)
    use_v1 = bool(OmegaConf.select(config, "trainer.use_v1", default=True))
    if not use_v1 and (given or mode == TRAINER_MODE):
        what = f"{SETTINGS_KEY} is set" if given else f"trainer.v1.trainer_mode={TRAINER_MODE}"
        raise ReductionConfigError(
            f"{what}, but trainer.use_v1=False runs verl's legacy trainer, which trains with "
            f"verl's own normalization: set trainer.use_v1=True (verl's default) and "
            f"trainer.v1.trainer_mode={TRAINER_MODE}"
        )
    if given and mode != TRAINER_MODE:
        why = (
            "an asynchronous trainer mode, which lossreduce does not run (its trainer mode is "
            "verl's synchronous PPO trainer)"
            if mode in ASYNC_TRAINER_MODES
            else "a trainer that trains with verl's own normalization"
        )
        raise ReductionConfigError(
            f"{SETTINGS_KEY} is set, but trainer.v1.trainer_mode={mode} is {why}: "
            f"set trainer.v1.trainer_mode={TRAINER_MODE}"
        )
    if mode == TRAINER_MODE:
        settings = reduction_settings(OmegaConf.select(config, SETTINGS_KEY, default=None))
        actor = config.actor_rollout_ref.actor
        problems = engine_problems(actor) + actor_problems(actor, settings)
        if use_critic:
            problems += engine_problems(config.critic, "critic")
            problems += critic_problems(config.critic, settings)
        raise_problems(problems, settings)


def reduction_settings(block: Any) -> VerlReductionSettings:
    """The launch's ``actor_rollout_ref.lossreduce`` block (a mapping, an OmegaConf node
    or None) over ``LOSSREDUCE_*``, validated; :class:`ReductionConfigError` names each bad
    key (``actor_rollout_ref.lossreduce.mode=bogus``) or variable, its value and what is
    allowed. The driver checks it before Ray starts; every worker builds its settings here
    too, from the block verl hands it."""
    if OmegaConf.is_config(block):
        block = OmegaConf.to_container(block, resolve=True)
    return validate_settings(
        VerlReductionSettings,
        dict(block or {}),
        what="verl's lossreduce settings",
        key_prefix=SETTINGS_KEY,
    )
