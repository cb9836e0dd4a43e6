"""The CPU launch's task as a SkyRL-gym environment: one turn, a dense letter reward.

The reward is the share of the response's letters among the row's ground truth (the
launch's :data:`~.launch.GOOD`), so GRPO's advantages are not all zero even for a
tiny untrained model. Registered as :data:`ENV` by :func:`register` in every worker
process of a CPU launch (:func:`.launch.worker_setup`).
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import register as register_env
from skyrl_gym.envs.registration import registry

__all__ = ["ENV", "LettersEnv", "register"]

ENV = "lossreduce_letters"
"""The environment's SkyRL-gym id (``environment.env_class``)."""


class LettersEnv(BaseTextEnv):  # type: ignore[misc]
    """One turn; the reward is the share of the response's letters among the ground
    truth's (``reward_spec.ground_truth``)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        del env_config
        self.good = set((extras or {})["reward_spec"]["ground_truth"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        letters = [c for c in action if c.isalpha()]
        reward = sum(c in self.good for c in letters) / max(len(letters), 1)
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


def register() -> None:
    """Register :class:`LettersEnv` as :data:`ENV` (once per process)."""
    if ENV not in registry:
        register_env(id=ENV, entry_point=f"{__name__}:LettersEnv")
