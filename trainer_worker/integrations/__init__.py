"""lossreduce inside other training frameworks: one package per framework.

- :mod:`lossreduce.trainer_worker.integrations.trl`: ``LossReduceGRPOTrainer``,
  Hugging Face TRL's ``GRPOTrainer`` with lossreduce's global normalizers
  (``pip install 'lossreduce[trl]'``). Imported explicitly: importing this
  package never imports a framework.
- :class:`GRPOReductionSettings`: how an integration normalizes its loss
  (mode, normalizer backend, coordinator, empty steps), read from
  ``LOSSREDUCE_*`` environment variables.

An integration never imports the train job (:mod:`lossreduce.trainer_worker.train`)
or another integration; the train job's engines build on the integrations.
"""

from lossreduce.trainer_worker.integrations.settings import (
    GRPOReductionSettings,
    NormalizerBackend,
)

__all__ = ["GRPOReductionSettings", "NormalizerBackend"]
