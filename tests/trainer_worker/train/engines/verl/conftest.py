"""verl in the test process, as the integration's tests import it (its CPU platform,
its import-time warnings filtered exactly): ``--verify`` replays a step on one verl
worker in the driver, which is the test process here. The Ray workers prepare their
own processes."""

from __future__ import annotations

from tests.trainer_worker.integrations.verl.verl_runs import prepare_test_process

prepare_test_process()
