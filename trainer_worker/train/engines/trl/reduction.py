"""The reduction settings of ``--engine trl``'s trainers, and their check before Ray starts.

Pure (no TRL import). Every worker's
:class:`~lossreduce.trainer_worker.integrations.trl.LossReduceGRPOTrainer` gets
the run's flags (``--mode``, ``--divisor``, ``--normalizer``, ``--on-empty-step``,
``--job``, ``--run``) and reads what no flag sets (``overlap``) from
``LOSSREDUCE_*`` variables. :func:`check_environment` builds the same settings in
the driver, so a bad variable stops the run before Ray starts, named with its
value and what is allowed, instead of in every worker after the cluster is up.
"""

from __future__ import annotations

from lossreduce.client import ClientSettings
from lossreduce.trainer_worker.integrations import GRPOReductionSettings, NormalizerBackend
from lossreduce.trainer_worker.integrations.settings_errors import validate_settings
from lossreduce.trainer_worker.policy_gradient import PolicyGradientMode
from lossreduce.trainer_worker.train.engines.base import REDUCTION_GROUP
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["FLAG_SOURCES", "check_environment", "reduction_settings"]

FLAG_SOURCES = {
    "mode": "--mode",
    "divisor": "--divisor",
    "normalizer": "--normalizer",
    "coordinator": "--coordinator",
    "on_empty_step": "--on-empty-step",
    "job": "--job",
    "run": "--run",
}
"""The flag each field of the trainer's reduction settings comes from."""

_EMBEDDED_STAND_IN = "embedded-coordinator:0"
"""The embedded coordinator's address is known only once Ray runs; any address
stands in for it when the driver checks the settings before."""


def reduction_settings(
    settings: TrainSettings,
    job: str,
    *,
    normalizer: NormalizerBackend,
    coordinator: str | None = None,
    client: ClientSettings | None = None,
) -> GRPOReductionSettings:
    """The trainer's reduction: the run's mode, divisor and empty-step rule, the rest
    from ``LOSSREDUCE_*``; :class:`~lossreduce.errors.ReductionConfigError` names a bad
    variable (or flag) and what is allowed."""
    return validate_settings(
        GRPOReductionSettings,
        {
            "mode": PolicyGradientMode(settings.mode),
            "divisor": settings.effective_divisor,
            "normalizer": normalizer,
            "coordinator": coordinator,
            "client": client or ClientSettings(),
            "on_empty_step": settings.on_empty_step,
            "job": job,
            "group": REDUCTION_GROUP,
            "run": settings.run,
        },
        what="--engine trl reduction settings",
        sources=FLAG_SOURCES,
    )


def check_environment(settings: TrainSettings) -> None:
    """Build the workers' reduction settings in the driver: a bad ``LOSSREDUCE_*``
    variable they would read raises :class:`~lossreduce.errors.ReductionConfigError`
    naming it. Ray copies a local cluster's environment from the driver; workers of a
    cluster started elsewhere read their own, and fail the same way at their start."""
    coordinator = settings.coordinator
    if settings.normalizer == "coordinator" and coordinator is None:
        coordinator = _EMBEDDED_STAND_IN
    reduction_settings(
        settings,
        settings.job or "train",
        normalizer=settings.normalizer,
        coordinator=coordinator,
    )
