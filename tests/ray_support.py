"""Local Ray sessions for tests: fresh, retried when the GCS or a raylet is slow, reaped.

On a loaded 2-core machine a head's GCS sometimes publishes its port after
Ray's wait for it ends (``RuntimeError: Timed out waiting for file
.../gcs_server_port_...``), or a raylet misses Ray's fixed 30 s registration
window (a bare ``Exception``), with the GCS and raylet it spawned still
running. ``tests/conftest.py`` raises the GCS wait of every Ray start of a test
run to :data:`GCS_PORT_WAIT_S` (Ray reads ``RAY_gcs_server_port_wait_time_s``; the
raylet's window is not configurable), and both are retried here. Left alone, their ``Popen``
objects are collected later, inside some unrelated test, as
"subprocess N is still running" ResourceWarnings (errors under
``-W error``). :func:`local_ray` kills and reaps what the failed start
left behind and tries again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray

from lossreduce.trainer_worker.train.ray_start import (
    LOCAL_START_ATTEMPTS as START_ATTEMPTS,
)
from lossreduce.trainer_worker.train.ray_start import (
    reap_ray_processes,
    start_timed_out,
)

__all__ = [
    "GCS_PORT_WAIT_S",
    "START_ATTEMPTS",
    "local_ray",
    "reap_ray_processes",
    "start_timed_out",
]

GCS_PORT_WAIT_S = 90
"""How long a head start waits for its GCS to publish its port (Ray's default: 30 s)."""


@contextmanager
def local_ray(num_cpus: int = 2, *, metrics_export_port: int | None = None) -> Iterator[None]:
    """A fresh local Ray session (ending any left over), shut down and waited for after.

    ``metrics_export_port`` sets where the node exports Prometheus metrics.
    """
    if ray.is_initialized():
        ray.shutdown(wait_for_processes=True)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            # address="local": a new cluster even where another runs on this machine.
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level="WARNING",
                log_to_driver=False,
                _metrics_export_port=metrics_export_port,
            )
            break
        except Exception as err:  # a bare Exception (raylet) or RuntimeError (GCS)
            ray.shutdown(wait_for_processes=True)
            reap_ray_processes()
            if attempt == START_ATTEMPTS or not start_timed_out(err):
                raise
    try:
        yield
    finally:
        ray.shutdown(wait_for_processes=True)
