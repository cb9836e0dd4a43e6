"""Which ``lossreduce train`` flags the TRL engine takes, judged on the settings.

Pure (no TRL import): :class:`TrainSettings` calls :func:`check_flags`
from its validator, so a flag the chosen engine cannot honour is refused with
one line naming it before anything starts. Every flag of the torch engine maps
onto TRL's GRPO configuration or the worker group; what ``--engine trl`` refuses
is the built-in model's shape next to ``--model``, and a batch that does not
split evenly into its processes and micro-steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossreduce.settings_cli import flag_name

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["BUILT_IN_MODEL_FLAGS", "check_flags"]

BUILT_IN_MODEL_FLAGS = ("d_model", "layers", "heads")
"""Shape the built-in policy; a ``--model`` checkpoint has its own shape."""


def check_flags(settings: TrainSettings) -> None:
    """Raise ValueError naming the first flag the TRL engine cannot honour."""
    given = settings.model_fields_set
    if settings.model is not None:
        for field in BUILT_IN_MODEL_FLAGS:
            if field in given:
                raise ValueError(
                    f"{flag_name(field)} shapes the built-in model; --model {settings.model} "
                    "brings its own"
                )
    rows = settings.prompts_per_step * settings.samples_per_prompt
    if rows % (settings.workers * settings.microbatches):
        raise ValueError(
            f"--engine trl: --prompts-per-step {settings.prompts_per_step} x "
            f"--samples-per-prompt {settings.samples_per_prompt} = {rows} completions per step "
            f"must split evenly into --workers {settings.workers} x --microbatches "
            f"{settings.microbatches} micro-batches"
        )
