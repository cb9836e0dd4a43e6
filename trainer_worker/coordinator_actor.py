"""The coordinator as a named Ray actor, restarted by Ray if it dies.

The actor runs the gRPC coordinator (``lossreduce.server.CoordinatorThread``)
inside its process. It is pinned to the driver's node and binds a port the
driver chose there, so when Ray restarts it (``max_restarts``) it comes back
at the *same* address: the workers' clients see ``UNAVAILABLE`` for a moment,
retry within their budget and re-send their (idempotent) contributions.

Security: the coordinator accepts only a bearer token made fresh for each run
(the driver hands it to the workers through Ray). On a one-node cluster it
listens on loopback only; on a multi-node cluster on every interface, where
the token travels in clear text — use an external coordinator with TLS
(``lossreduce serve`` + ``--coordinator``) on untrusted networks.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import ray
from pydantic import SecretStr
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = [
    "COORDINATOR_MAX_RESTARTS",
    "LOOPBACK",
    "CoordinatorActor",
    "CoordinatorHandle",
    "free_port",
    "start_coordinator_actor",
]

COORDINATOR_MAX_RESTARTS = 3
"""How often Ray restarts a coordinator actor that died."""

LOOPBACK = "127.0.0.1"


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class CoordinatorActor:
    """Serves the coordinator's gRPC API (and /metrics) from a Ray actor."""

    def __init__(self, host: str, port: int, round_timeout_s: float, token: SecretStr) -> None:
        from lossreduce.server import CoordinatorSettings, CoordinatorThread

        settings = CoordinatorSettings(
            host=host, port=port, metrics_port=0, round_timeout_s=round_timeout_s, token=token
        )
        self._thread = CoordinatorThread(settings).start()
        # Workers on other nodes dial this node's IP; on loopback, the loopback address.
        dial = host if host == LOOPBACK else ray.util.get_node_ip_address()
        self._target = f"{dial}:{self._thread.port}"

    def target(self) -> str:
        """``HOST:PORT`` the workers dial."""
        return self._target

    def metrics_port(self) -> int | None:
        """Port of the coordinator's Prometheus ``/metrics`` endpoint."""
        port: int | None = self._thread.metrics_port
        return port

    def stop(self) -> None:
        self._thread.stop()


@dataclass(frozen=True)
class CoordinatorHandle:
    """A started coordinator actor and the address it serves on."""

    actor: Any
    name: str
    target: str

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the actor serves (raises the actor's error if it could not start)."""
        served: str = ray.get(self.actor.target.remote(), timeout=timeout_s)
        assert served == self.target, (served, self.target)

    def stop(self) -> None:
        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        finally:
            ray.kill(self.actor, no_restart=True)


def start_coordinator_actor(
    job: str, round_timeout_s: float, token: SecretStr
) -> CoordinatorHandle:
    """Start the named coordinator actor for ``job`` on this node.

    Returns at once: the address is known up front (this node, a port chosen
    here), so the workers can start meanwhile; :meth:`CoordinatorHandle.wait_ready`
    waits for it to serve.
    """
    name = f"lossreduce-coordinator-{job}"
    node_id = ray.get_runtime_context().get_node_id()
    one_node = sum(1 for node in ray.nodes() if node.get("Alive")) == 1
    host = LOOPBACK if one_node else "0.0.0.0"
    port = free_port(host)
    target = f"{host if one_node else ray.util.get_node_ip_address()}:{port}"
    actor_cls = ray.remote(CoordinatorActor)
    actor = actor_cls.options(
        name=name,
        num_cpus=0,
        max_restarts=COORDINATOR_MAX_RESTARTS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(host, port, round_timeout_s, token)
    return CoordinatorHandle(actor=actor, name=name, target=target)
