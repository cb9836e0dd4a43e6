"""Which ``lossreduce train`` flags the verl engine takes, judged on the settings.

Pure (no verl import): :class:`TrainSettings` calls :func:`check_flags` from
its validator, so a flag the engine cannot honour is refused in one line naming
it before anything starts. The engine trains the built-in tiny Qwen2 over the
digit task's token ids, so it refuses ``--model`` (a checkpoint with a
tokenizer of its own vocabulary would need the task rendered as text, as
``--engine trl`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["check_flags"]


def check_flags(settings: TrainSettings) -> None:
    """Raise ValueError naming the first flag the verl engine cannot honour."""
    if settings.model is not None:
        raise ValueError(
            f"--model {settings.model}: --engine verl trains the built-in tiny Qwen2 over the "
            "task's token ids only (shape it with --d-model, --layers and --heads)"
        )
