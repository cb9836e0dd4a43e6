"""SkyRL's trainer config with lossreduce's settings block, and the launch check.

SkyRL parses a launch's ``key.path=value`` arguments strictly into its config
dataclasses and dispatches ``trainer.override_entrypoint=<module>`` to that module's
``main()`` before it parses them, so that an integration can parse them with a config
of its own. :data:`LossReduceSkyRLConfig` is SkyRL's ``SkyRLTrainConfig`` whose
``trainer`` has one more field, ``lossreduce``: the block of
:class:`~.settings.SkyRLReductionSettings` (``trainer.lossreduce.mode=prompt_mean``).

:func:`reduction_settings` turns that block (over ``LOSSREDUCE_*``) into settings and
:func:`check_launch` refuses what cannot run, naming the key, its value and what is
allowed; the entrypoint calls it in the driver before Ray starts, every policy worker
again when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.config.config import TrainerConfig, make_config

from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.integrations.skyrl.options import config_problems, raise_problems
from lossreduce.trainer_worker.integrations.skyrl.settings import SkyRLReductionSettings

__all__ = [
    "ENTRYPOINT",
    "SETTINGS_KEY",
    "LossReduceSkyRLConfig",
    "LossReduceTrainerConfig",
    "check_launch",
    "reduction_settings",
]

ENTRYPOINT = "lossreduce.trainer_worker.integrations.skyrl.entrypoint"
"""What ``trainer.override_entrypoint`` names to train with lossreduce."""
SETTINGS_KEY = "trainer.lossreduce"
"""Where a launch gives lossreduce's settings (``trainer.lossreduce.mode=seq_mean``)."""


@dataclass
class LossReduceTrainerConfig(TrainerConfig):  # type: ignore[misc]
    """SkyRL's ``TrainerConfig`` with lossreduce's settings block."""

    lossreduce: dict[str, Any] = field(default_factory=dict)
    """:class:`~.settings.SkyRLReductionSettings` fields (``mode``, ``normalizer``, ...);
    fields not given read ``LOSSREDUCE_*``."""


LossReduceSkyRLConfig: type[SkyRLTrainConfig] = make_config(trainer_cls=LossReduceTrainerConfig)
"""SkyRL's root config with :class:`LossReduceTrainerConfig` as its ``trainer``."""


def reduction_settings(trainer: Any) -> SkyRLReductionSettings:
    """The ``lossreduce`` block of SkyRL's trainer config over ``LOSSREDUCE_*``, validated;
    :class:`~lossreduce.errors.ReductionConfigError` names each bad key
    (``trainer.lossreduce.mode=bogus``) or variable, its value and what is allowed."""
    block = getattr(trainer, "lossreduce", None)
    return validate_settings(
        SkyRLReductionSettings,
        dict(block or {}),
        what="SkyRL's lossreduce settings",
        key_prefix=SETTINGS_KEY,
    )


def check_launch(cfg: Any) -> SkyRLReductionSettings:
    """The launch's settings, or :class:`~lossreduce.errors.ReductionConfigError` naming
    every setting and every SkyRL option that cannot run together."""
    settings = reduction_settings(cfg.trainer)
    raise_problems(config_problems(cfg.trainer, settings), settings)
    return settings
