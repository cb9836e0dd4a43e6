"""Which ``lossreduce train`` flags the AReaL engine takes, judged on the settings.

Pure (no AReaL import): :class:`TrainSettings` calls :func:`check_flags` from
its validator, so a flag the engine cannot honour is refused with one line
naming it before anything starts. The engine trains the built-in tiny Qwen2
over the task's token ids (shaped by ``--d-model``, ``--layers``, ``--heads``),
so it refuses ``--model``: a foreign checkpoint's ids are not the task's.
Every rank samples its slice of the step's prompts at once (each forward of
AReaL's FSDP actor all-gathers the parameter shards), so every rank needs one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["check_flags"]


def check_flags(settings: TrainSettings) -> None:
    """Raise ValueError naming the first flag the AReaL engine cannot honour."""
    if settings.model is not None:
        raise ValueError(
            f"--model {settings.model}: --engine areal trains the built-in tiny Qwen2 over the "
            "task's token ids (--d-model, --layers, --heads), not a Hugging Face checkpoint"
        )
    if settings.prompts_per_step < settings.workers:
        raise ValueError(
            f"--engine areal: --prompts-per-step {settings.prompts_per_step} is fewer than "
            f"--workers {settings.workers}; every rank samples at least one prompt (the FSDP "
            "ranks run every forward together)"
        )
