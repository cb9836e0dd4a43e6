"""The coordinator as a named Ray actor, restarted by Ray if it dies.

Shared by the train job (its driver starts one per run) and the integrations
(a framework's ranks with ``normalizer='coordinator'`` and no address start or
join one, :func:`join_coordinator_actor`).

The actor runs the gRPC coordinator (``lossreduce.server.CoordinatorThread``)
inside its process. It is pinned to the driver's node and binds a port the
driver chose there, so when Ray restarts it (``max_restarts``) it comes back
at the *same* address: the workers' clients see ``UNAVAILABLE`` for a moment,
retry within their budget and re-send their (idempotent) contributions.

Restarts: the actor journals every finished round to a SQLite file on this
node (:func:`default_journal`, in the temp dir), so the restarted process
answers a retry of a round that finished before the crash identically
instead of collecting it again (see docs/guarantees.md).

Security: the coordinator accepts only a bearer token made fresh for each run
(the driver hands it to the workers through Ray). On a one-node cluster it
listens on loopback only; on a multi-node cluster on every interface, and
then over TLS with a CA made for the run (:mod:`lossreduce.trainer_worker.integrations.tls`):
the server key reaches the actor as a constructor argument, in memory; the
coordinator reads its TLS material from files only, so the actor writes the
pair to 0600 files in a private (0700) temp dir on this node and removes them
as soon as the server has read them, before it serves a single call.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import SecretStr
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lossreduce.errors import UsageError
from lossreduce.ports import LOOPBACK, free_port
from lossreduce.trainer_worker.integrations.tls import ServerTls, make_run_tls

__all__ = [
    "COORDINATOR_MAX_RESTARTS",
    "LOOPBACK",
    "CoordinatorActor",
    "CoordinatorEndpoint",
    "CoordinatorHandle",
    "JoinedCoordinator",
    "default_journal",
    "join_coordinator_actor",
    "start_coordinator_actor",
]

COORDINATOR_MAX_RESTARTS = 3
"""How often Ray restarts a coordinator actor that died."""


class CoordinatorActor:
    """Serves the coordinator's gRPC API (and /metrics) from a Ray actor."""

    def __init__(
        self,
        host: str,
        port: int,
        round_timeout_s: float,
        token: SecretStr,
        journal: Path | None = None,
        *,
        tls: ServerTls | None = None,
        ca_cert: bytes | None = None,
    ) -> None:
        from lossreduce.server import CoordinatorSettings, CoordinatorThread

        self._token = token
        self._ca_cert = ca_cert
        with _tls_files(tls) as (cert, key):
            # A restarted actor reopens the same journal and answers retries of the
            # rounds its previous incarnation finished (docs/guarantees.md).
            settings = CoordinatorSettings(
                host=host,
                port=port,
                metrics_port=0,
                round_timeout_s=round_timeout_s,
                token=token,
                journal=journal,
                tls_cert=cert,
                tls_key=key,
            )
            self._thread = CoordinatorThread(settings).start()
        # Workers on other nodes dial this node's IP; on loopback, the loopback address.
        dial = host if host == LOOPBACK else ray.util.get_node_ip_address()
        self._target = f"{dial}:{self._thread.port}"

    def target(self) -> str:
        """``HOST:PORT`` the workers dial."""
        return self._target

    def endpoint(self) -> CoordinatorEndpoint:
        """What a rank that joins this coordinator needs: where, the token, the CA."""
        return CoordinatorEndpoint(self._target, self._token, self._ca_cert)

    def metrics_port(self) -> int | None:
        """Port of the coordinator's Prometheus ``/metrics`` endpoint."""
        port: int | None = self._thread.metrics_port
        return port

    def pid(self) -> int:
        """This incarnation's process id: it changes when Ray restarts the actor."""
        return os.getpid()

    def stop(self) -> None:
        self._thread.stop()


@contextmanager
def _tls_files(tls: ServerTls | None) -> Iterator[tuple[Path | None, Path | None]]:
    """The pair as 0600 files in a fresh 0700 dir, removed on exit (the server reads
    them once, at start)."""
    if tls is None:
        yield None, None
        return
    folder = Path(tempfile.mkdtemp(prefix="lossreduce-tls-"))
    try:
        paths = folder / "cert.pem", folder / "key.pem"
        for path, data in zip(paths, (tls.cert_chain, tls.private_key), strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        yield paths
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class CoordinatorEndpoint:
    """How a rank reaches a coordinator actor: ``HOST:PORT``, the bearer token, and the
    PEM CA its certificate chains to (None: plaintext on loopback)."""

    target: str
    token: SecretStr
    ca_cert: bytes | None


@dataclass(frozen=True)
class JoinedCoordinator:
    """A job's coordinator actor as a rank joined it. Keep it while the rank trains:
    Ray ends an actor nobody holds a handle to."""

    endpoint: CoordinatorEndpoint
    actor: Any


@dataclass(frozen=True)
class CoordinatorHandle:
    """A started coordinator actor, the address it serves on, and the CA it chains to
    (None: plaintext on loopback)."""

    actor: Any
    name: str
    target: str
    journal: Path | None = None
    ca_cert: bytes | None = None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the actor serves (raises the actor's error if it could not start)."""
        served: str = ray.get(self.actor.target.remote(), timeout=timeout_s)
        assert served == self.target, (served, self.target)

    def stop(self) -> None:
        """Stop serving and end the actor; one that already died (or hangs) is just killed,
        so stopping never raises over the error that ended the run."""
        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        except (RayActorError, GetTimeoutError):
            pass  # dead or unresponsive: the kill below ends it either way
        finally:
            ray.kill(self.actor, no_restart=True)
            if self.journal is not None:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{self.journal}{suffix}").unlink(missing_ok=True)


def default_journal(job: str, run_id: str | None = None) -> Path:
    """Where the coordinator actor of ``job`` journals: this node's temp dir.

    ``run_id`` tells runs of the same job apart: a journal left behind by a run
    whose driver died must not answer the next run's rounds as if they were
    retries (a fresh coordinator looks up the journal's steps).
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)
    run = f"-{run_id}" if run_id else ""
    return Path(tempfile.gettempdir()) / f"lossreduce-coordinator-{safe}{run}.sqlite3"


def start_coordinator_actor(
    job: str,
    round_timeout_s: float,
    token: SecretStr,
    journal: Path | Literal["tmp"] | None = "tmp",
    *,
    get_if_exists: bool = False,
) -> CoordinatorHandle:
    """Start the named coordinator actor for ``job`` on this node.

    Returns at once: the address is known up front (this node, a port chosen
    here), so the workers can start meanwhile; :meth:`CoordinatorHandle.wait_ready`
    waits for it to serve. The actor journals finished rounds to ``journal``
    (``"tmp"``: :func:`default_journal`, a file new to this run; None: no
    journal); it is pinned to this node, so a restarted actor (same arguments)
    finds the file again. ``stop()`` deletes it.

    On more than one node the coordinator listens on every interface, over TLS
    with a CA made for this run (:attr:`CoordinatorHandle.ca_cert`).

    ``get_if_exists``: when the job's actor already runs, return a handle to it
    instead (its :meth:`CoordinatorActor.endpoint` is then the truth, not the
    handle's ``target``, token or CA, which describe the actor this call would
    have started).
    """
    journal_path = default_journal(job, secrets.token_hex(6)) if journal == "tmp" else journal
    assert not isinstance(journal_path, str)
    name = f"lossreduce-coordinator-{job}"
    node_id = ray.get_runtime_context().get_node_id()
    one_node = sum(1 for node in ray.nodes() if node.get("Alive")) == 1
    host = LOOPBACK if one_node else "0.0.0.0"
    port = free_port(host)
    node_ip = ray.util.get_node_ip_address()
    target = f"{host if one_node else node_ip}:{port}"
    tls = None if one_node else make_run_tls(job, [node_ip])
    actor_cls = ray.remote(CoordinatorActor)
    actor = actor_cls.options(
        name=name,
        get_if_exists=get_if_exists,
        num_cpus=0,
        max_restarts=COORDINATOR_MAX_RESTARTS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(
        host,
        port,
        round_timeout_s,
        token,
        journal_path,
        tls=None if tls is None else tls.server,
        ca_cert=None if tls is None else tls.ca_cert,
    )
    return CoordinatorHandle(
        actor=actor,
        name=name,
        target=target,
        journal=journal_path,
        ca_cert=None if tls is None else tls.ca_cert,
    )


def join_coordinator_actor(
    job: str, *, round_timeout_s: float, startup_timeout_s: float
) -> JoinedCoordinator:
    """The endpoint of ``job``'s coordinator actor on this process's Ray cluster,
    started here (on this node, with a fresh token, over TLS when the cluster has
    several nodes) unless a peer started it first.

    Every rank of a job calls this; Ray's ``get_if_exists`` makes exactly one of
    them create the actor, and all of them read the same endpoint from it. The
    actor is not detached: it lives while the process that created it does and
    some rank holds the returned handle, in the Ray namespace of the calling
    job. Raises
    :class:`~lossreduce.errors.UsageError` outside a Ray cluster.
    """
    if not ray.is_initialized():
        raise UsageError(
            f"job {job!r}: normalizer='coordinator' without a coordinator address starts or "
            "joins the job's coordinator actor on its Ray cluster, but this process is not "
            "connected to one; pass coordinator=HOST:PORT (LOSSREDUCE_COORDINATOR)"
        )
    fresh = SecretStr(secrets.token_urlsafe(32))
    handle = start_coordinator_actor(job, round_timeout_s, fresh, get_if_exists=True)
    try:
        endpoint: CoordinatorEndpoint = ray.get(
            handle.actor.endpoint.remote(), timeout=startup_timeout_s
        )
    except GetTimeoutError as err:
        raise UsageError(
            f"job {job!r}: the coordinator actor {handle.name!r} did not answer within "
            f"{startup_timeout_s:g} s"
        ) from err
    return JoinedCoordinator(endpoint, handle.actor)
