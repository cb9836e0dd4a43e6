"""lossreduce inside other training frameworks: one package per framework.

- :mod:`lossreduce.trainer_worker.integrations.trl`: ``LossReduceGRPOTrainer``,
  Hugging Face TRL's ``GRPOTrainer`` with lossreduce's global normalizers
  (``pip install 'lossreduce[trl]'``). Imported explicitly: importing this
  package never imports a framework.
- :class:`ReductionSettings`: how an integration normalizes its loss (mode,
  normalizer backend, coordinator, empty steps), read from ``LOSSREDUCE_*``
  environment variables; :class:`GRPOReductionSettings` is TRL's, and verl and
  AReaL have theirs in their packages.
- ``run_identity``: the one way every integration (and ``lossreduce train``)
  resolves the run its rounds carry, and the default job names built from it.
- ``coordinator_actor`` and ``tls``: the coordinator as a named Ray actor, and
  the private CA of a run over several nodes, shared by the train job and the
  integrations that start or join one.

An integration never imports the train job (:mod:`lossreduce.trainer_worker.train`)
or another integration; the train job's engines build on the integrations.
"""

from lossreduce.trainer_worker.integrations.settings import (
    GRPOReductionSettings,
    NormalizerBackend,
    ReductionSettings,
)

__all__ = ["GRPOReductionSettings", "NormalizerBackend", "ReductionSettings"]
