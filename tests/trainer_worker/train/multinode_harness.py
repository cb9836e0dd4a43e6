"""A real Ray cluster of several raylets on this machine, for one test module.

``ray.cluster_utils.Cluster`` starts a head and extra raylets, each with its
own (logical) CPUs: placement groups, node affinity and node death behave as
on a cluster of machines, though every node shares this machine's IP. The
GCS health check is tightened so a removed raylet is declared dead in a few
seconds rather than Ray's default of about 15.

The head gets ``dashboard_port=None``: with a port given (``Cluster``'s
default is 8265, even with the dashboard off) Ray's ``start_api_server``
(ray/_private/services.py) first binds a test socket to it and, when another
Ray on this machine holds the port, raises without closing that socket; it is
collected later, inside some other test, as an unclosed-socket
``ResourceWarning`` (an error under ``-W error``). With None Ray skips that
check and lets the API server pick a port itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from tests.ray_support import START_ATTEMPTS, reap_ray_processes, start_timed_out

__all__ = ["NODE_CPUS", "local_cluster", "session_logs"]

NODE_CPUS = 2
"""Logical CPUs per raylet: enough for two workers on each of three nodes."""


@contextmanager
def local_cluster(nodes: int = 3) -> Iterator[Cluster]:
    """A head plus ``nodes - 1`` raylets, joined by this process; all shut down after.

    A start whose head GCS publishes its port too late, or in which a node misses
    Ray's fixed 30 s registration window, is torn down and tried again (up to
    ``START_ATTEMPTS``), as ``local_ray`` does.
    """
    if ray.is_initialized():
        ray.shutdown()
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            cluster = _start_cluster(nodes)
            break
        except Exception as err:  # Ray's errors for a slow GCS or raylet
            if attempt == START_ATTEMPTS or not start_timed_out(err):
                raise
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def _start_cluster(nodes: int) -> Cluster:
    """The head and its raylets, all registered; on failure nothing of it is left running."""
    cluster: Cluster | None = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": NODE_CPUS,
                "include_dashboard": False,
                # No port check, hence no socket leaked by it (see the module docstring).
                "dashboard_port": None,
                "_system_config": {
                    "health_check_period_ms": 1000,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
    except Exception:
        if cluster is not None:
            # The start's own error is the one to report (and to retry on).
            with contextlib.suppress(Exception):
                cluster.shutdown()
        reap_ray_processes()  # what a failed node start left behind
        raise
    return cluster


def session_logs(cluster: Cluster) -> list[Path]:
    """Every log file of the cluster's session (driver, actors, raylets)."""
    logs = Path(cluster.head_node.get_session_dir_path()) / "logs"
    return [path for path in logs.rglob("*") if path.is_file()]
