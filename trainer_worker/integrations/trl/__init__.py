"""lossreduce inside Hugging Face TRL: :class:`LossReduceGRPOTrainer`.

Needs ``pip install 'lossreduce[trl]'``: importing this package imports TRL and
checks its version (:data:`TRL_TESTED`). The trainer is in
:mod:`~lossreduce.trainer_worker.integrations.trl.trainer` (its round per optimizer
step in :mod:`~lossreduce.trainer_worker.integrations.trl.window`, what it
supports in :mod:`~lossreduce.trainer_worker.integrations.trl.options`), the end-to-end cost
measurement of ``lossreduce bench --e2e`` in
:mod:`~lossreduce.bench.frameworks.trl`.
"""

from lossreduce.trainer_worker.integrations.trl.options import TRL_TESTED, check_trl_version
from lossreduce.trainer_worker.integrations.trl.trainer import LossReduceGRPOTrainer

__all__ = ["TRL_TESTED", "LossReduceGRPOTrainer", "check_trl_version"]
