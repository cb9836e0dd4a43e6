"""Which ``lossreduce train`` flags the torch engine takes, judged on the settings.

Pure: :class:`~lossreduce.trainer_worker.train.train_settings.TrainSettings`
calls :func:`check_flags` from its validator. The torch engine trains its own
small policy (shaped by ``--d-model``, ``--layers``, ``--heads``), so it refuses
``--model``, which names a Hugging Face checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossreduce.settings_cli import flag_name

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["CHECKPOINT_FLAGS", "check_flags"]

CHECKPOINT_FLAGS = ("model",)
"""Flags that name a Hugging Face checkpoint, which this engine does not train."""


def check_flags(settings: TrainSettings) -> None:
    """Raise ValueError naming the first flag the torch engine cannot honour."""
    for field in CHECKPOINT_FLAGS:
        if getattr(settings, field) is not None:
            raise ValueError(
                f"{flag_name(field)} names a Hugging Face checkpoint, which --engine "
                f"{settings.engine} does not train (it builds its own policy from --d-model, "
                "--layers and --heads)"
            )
