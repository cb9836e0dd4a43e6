"""``--engine verl``: verl's real actor worker on every Ray worker.

Each worker (:mod:`.worker`) runs
:class:`~lossreduce.trainer_worker.integrations.verl.LossReduceTrainingWorker`
(verl's ``TrainingWorker`` on its FSDP2 engine, normalized by lossreduce) on the
built-in tiny Qwen2 over the digit task's token ids
(:mod:`lossreduce.trainer_worker.train.hf_policy`). verl's own rollouts need
vLLM or SGLang servers, so the rollouts come from the job's sampler
(:mod:`lossreduce.trainer_worker.train.rollouts`) on a plain copy of the policy
that each worker refreshes from verl's weights after every step; the driver's
side is :mod:`.engine`. Needs verl 0.9.1 (``pip install 'lossreduce[verl]'`` into the
environment of ``pip install 'verl[vllm]==0.9.1'``): only :meth:`EngineSpec.load` looks for it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from lossreduce.trainer_worker.train.engines.base import EngineFactory, EngineSpec
from lossreduce.trainer_worker.train.engines.verl.flags import check_flags

__all__ = ["ENGINE", "INSTALL_HINT", "TESTED_VERL"]

TESTED_VERL = "0.9.1"
"""The verl version this engine is tested with (the ``verl`` extra requires >=0.9.1,<0.10)."""
INSTALL_HINT = (
    f"pip install 'lossreduce[verl]' into a verl=={TESTED_VERL} environment "
    f"(pip install 'verl[vllm]=={TESTED_VERL}'), or `make test-verl` for the "
    "repository's .venv-verl; see docs/frameworks/verl.md"
)


def _load() -> EngineFactory:
    # find_spec, not an import: importing verl is slow and needs its platform set first.
    if importlib.util.find_spec("verl") is None:
        raise ImportError(f"verl is not installed in this environment: {INSTALL_HINT}")
    found = importlib.metadata.version("verl")
    if found != TESTED_VERL:
        raise ImportError(
            f"verl {found} is installed, but this engine is tested with {INSTALL_HINT}"
        )
    from lossreduce.trainer_worker.train.engines.verl.engine import VerlEngine

    return VerlEngine


ENGINE = EngineSpec(
    name="verl",
    summary="verl's FSDP2 actor worker per worker, LossReduceTrainingWorker, rollouts from "
    "the job's sampler; needs pip install 'lossreduce[verl]'",
    check_flags=check_flags,
    load=_load,
)
