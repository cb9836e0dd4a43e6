"""verl in the test process: its CPU platform, and its import-time warnings filtered exactly.

verl warns on import for every optional engine it cannot load here (Megatron,
TorchTitan, VeOmni, ...) and through Ray's deprecated state API; the pytest
config turns warnings into errors, so verl is imported once here with exactly
those filtered. The ranks the tests spawn set the same environment themselves.
"""

from __future__ import annotations

import os
import warnings

from tests.trainer_worker.integrations.verl.verl_runs import VERL_ENV

for key, value in VERL_ENV.items():
    os.environ.setdefault(key, value)

with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore",
        message=r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available",
        category=UserWarning,
    )
    warnings.filterwarnings(
        "ignore", message="Ray state API is no longer experimental", category=DeprecationWarning
    )
    import verl.workers.engine_workers  # noqa: F401
