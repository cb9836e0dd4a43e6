"""verl in the test process: its CPU platform, and its import-time warnings filtered exactly.

verl warns on import for every optional engine it cannot load here (Megatron,
TorchTitan, VeOmni, ...) and through Ray's deprecated state API; the pytest
config turns warnings into errors, so verl is imported once here with exactly
those filtered. The ranks the tests spawn set the same environment themselves.
"""

from __future__ import annotations

from tests.trainer_worker.integrations.verl.verl_runs import prepare_test_process

prepare_test_process()
