"""lossreduce inside Hugging Face TRL: :class:`LossReduceGRPOTrainer`.

Needs ``pip install 'lossreduce[trl]'``: importing this package imports TRL and
checks its version (:data:`TRL_TESTED`). The trainer is in
:mod:`~lossreduce.trainer_worker.integrations.trl.trainer`, the end-to-end cost
measurement of ``lossreduce bench --e2e`` in
:mod:`~lossreduce.trainer_worker.integrations.trl.bench`.
"""

from lossreduce.trainer_worker.integrations.trl.trainer import (
    TRL_TESTED,
    LossReduceGRPOTrainer,
    check_trl_version,
)

__all__ = ["TRL_TESTED", "LossReduceGRPOTrainer", "check_trl_version"]
