"""lossreduce inside other training frameworks.

- :mod:`lossreduce.trainer_worker.integrations.trl`: ``LossReduceGRPOTrainer``,
  Hugging Face TRL's ``GRPOTrainer`` with lossreduce's global normalizers
  (``pip install 'lossreduce[trl]'``). Imported explicitly: importing this
  package never imports TRL.
- :class:`GRPOReductionSettings`: how that trainer normalizes its loss.
"""

from lossreduce.trainer_worker.integrations.grpo_settings import (
    GRPOReductionSettings,
    NormalizerBackend,
)

__all__ = ["GRPOReductionSettings", "NormalizerBackend"]
