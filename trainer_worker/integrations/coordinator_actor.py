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

Journal lifetime: a clean end removes the files (``CoordinatorHandle.stop``, the
actor's own ``stop``, and, for a joined actor, ``JoinedCoordinator.close`` or a
clean exit of the process that created it); a crash keeps them. Every live actor holds a shared ``flock`` on its
journal, and each start on the node removes the journals nobody holds that are
older than :class:`ActorJournalSettings` ``journal_retention_days`` (also those
of jobs whose Ray tore the actor down without a clean end).

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

import atexit
import fcntl
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lossreduce.errors import UsageError
from lossreduce.ports import LOOPBACK, free_port
from lossreduce.trainer_worker.integrations.tls import ServerTls, make_run_tls

__all__ = [
    "COORDINATOR_MAX_RESTARTS",
    "COORDINATOR_NAMESPACE",
    "LOOPBACK",
    "ActorJournalSettings",
    "CoordinatorActor",
    "CoordinatorEndpoint",
    "CoordinatorHandle",
    "JoinedCoordinator",
    "coordinator_actor_name",
    "default_journal",
    "get_coordinator_actor",
    "join_coordinator_actor",
    "remove_journal",
    "start_coordinator_actor",
    "sweep_journals",
]

COORDINATOR_MAX_RESTARTS = 3
"""How often Ray restarts a coordinator actor that died."""

_JOURNAL_SUFFIXES = ("", "-wal", "-shm")
"""The SQLite journal and its write-ahead log and shared-memory index (WAL mode)."""

_RUN_ID_BYTES = 6
"""Random bytes of a run id (:func:`default_journal`): 12 hex digits in the name."""

_JOURNAL_NAME = re.compile(
    rf"lossreduce-coordinator-.+-[0-9a-f]{{{2 * _RUN_ID_BYTES}}}\.sqlite3(?:-wal|-shm)?"
)
"""A journal file :func:`default_journal` names for some run: what the sweep may remove."""


_OWNED_JOURNALS: set[Path] = set()
"""Journals of the coordinator actors this process created through
:func:`join_coordinator_actor`: removed when it exits cleanly."""


@atexit.register
def _remove_owned_journals() -> None:
    # Files only, no Ray call: at interpreter exit Ray may be half shut down. The
    # actors are not detached and end with this process; Ray never restarts an actor
    # whose owner is gone, so nothing reads these journals again.
    for journal in sorted(_OWNED_JOURNALS):
        remove_journal(journal)


class ActorJournalSettings(BaseSettings):
    """How long the journals of crashed coordinator actors stay on a node."""

    model_config = SettingsConfigDict(
        env_prefix="LOSSREDUCE_COORDINATOR_", frozen=True, extra="forbid"
    )

    journal_retention_days: float = Field(
        default=7.0,
        gt=0,
        description=(
            "Days a coordinator actor's journal left behind (a crash, or a job whose Ray "
            "tore the actor down) stays in its directory (the node's temp dir): every "
            "start of a coordinator actor on the node removes the journals no live "
            "coordinator holds and no round was written to for longer. A clean end "
            "removes its journal at once."
        ),
    )


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
        self._journal = journal
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
        # Held while this process lives, however it ends: the sweep of a later start
        # never removes the journal of a live coordinator (sweep_journals).
        self._hold = None if journal is None else _hold_journal(journal)
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
        """Stop serving and remove the journal: a clean end, nothing left to recover."""
        self._thread.stop()  # closes the journal first
        if self._hold is not None:
            os.close(self._hold)  # after SQLite's close: closing drops this process's locks
            self._hold = None
        if self._journal is not None:
            remove_journal(self._journal)

    def __ray_shutdown__(self) -> None:
        """Ray calls this when the actor ends gracefully: every handle dropped, and at
        times when its owner dies (Ray ends such an actor either way), never when it is
        killed: a crash keeps the journal for the restart."""
        self.stop()


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
    Ray ends an actor nobody holds a handle to.

    ``journal``: set on the rank whose call created the actor (its owner: the actor
    dies with this process), which removes the journal when this process exits
    cleanly; None on the others.
    """

    endpoint: CoordinatorEndpoint
    actor: Any
    journal: Path | None = None

    def close(self, timeout_s: float = 30.0) -> None:
        """On the rank that created the actor: stop it cleanly (its journal goes with it)
        and end it; a no-op on the other ranks. Call it once every rank is done: the
        others' rounds fail after it. Optional: a clean exit of this process does the
        same for the journal, but Ray ending a job kills its actors without one."""
        if self.journal is None:
            return
        try:
            ray.get(self.actor.stop.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            pass  # dead or unresponsive: the kill below ends it either way
        finally:
            ray.kill(self.actor, no_restart=True)
            remove_journal(self.journal)
            _OWNED_JOURNALS.discard(self.journal)


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
                remove_journal(self.journal)


def default_journal(job: str, run_id: str | None = None, directory: Path | None = None) -> Path:
    """Where the coordinator actor of ``job`` journals: ``directory``, else this node's
    temp dir (``TMPDIR``).

    ``run_id`` tells runs of the same job apart: a journal left behind by a run
    whose driver died must not answer the next run's rounds as if they were
    retries (a fresh coordinator looks up the journal's steps).
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)
    run = f"-{run_id}" if run_id else ""
    folder = Path(tempfile.gettempdir()) if directory is None else directory
    return folder / f"lossreduce-coordinator-{safe}{run}.sqlite3"


def _hold_journal(journal: Path) -> int | None:
    """A descriptor holding a shared ``flock`` on ``journal`` (None when it cannot be
    opened); the kernel releases it when the process ends, however it ends."""
    try:
        fd = os.open(journal, os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _in_use(journal: Path) -> bool:
    """Whether a live coordinator holds ``journal`` (:func:`_hold_journal`)."""
    try:
        fd = os.open(journal, os.O_RDONLY)
    except OSError:
        return False  # no main file left: only a stray -wal or -shm
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock just taken
    return False


def remove_journal(journal: Path) -> None:
    """Delete ``journal`` and its ``-wal`` and ``-shm`` files (those present)."""
    for suffix in _JOURNAL_SUFFIXES:
        Path(f"{journal}{suffix}").unlink(missing_ok=True)


def sweep_journals(directory: Path, retention_s: float, now: float | None = None) -> list[Path]:
    """Remove the coordinator journals in ``directory`` (any job's: job names are often
    new for every run) that no live coordinator holds and no round was written to
    for ``retention_s``; the ones removed. A journal counts as written when its
    newest file (``-wal`` included) was.

    Files another user owns, or that vanish meanwhile (a peer rank sweeping too),
    are skipped: the sweep never fails a start.
    """
    now = time.time() if now is None else now
    newest: dict[Path, float] = {}
    try:
        names = [path for path in directory.iterdir() if _JOURNAL_NAME.fullmatch(path.name)]
    except OSError:
        return []
    for path in names:
        base = Path(re.sub(r"-(?:wal|shm)$", "", str(path)))
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        newest[base] = max(mtime, newest.get(base, mtime))
    removed = []
    for base, mtime in sorted(newest.items()):
        # Age first: only old files are opened to test their lock.
        if now - mtime <= retention_s or _in_use(base):
            continue
        try:
            remove_journal(base)
        except OSError:
            continue  # another user's file, in a shared temp dir
        removed.append(base)
    return removed


COORDINATOR_NAMESPACE = "lossreduce"
"""The Ray namespace of every coordinator actor: ranks that are each their own Ray driver
(torchrun, accelerate) get an anonymous namespace each, and would start one actor apiece
instead of meeting at the job's."""


def coordinator_actor_name(job: str) -> str:
    """The Ray actor name of ``job``'s coordinator (in :data:`COORDINATOR_NAMESPACE`)."""
    return f"lossreduce-coordinator-{job}"


def get_coordinator_actor(job: str) -> Any:
    """A handle to ``job``'s running coordinator actor, whatever the caller's namespace
    (``ValueError`` when none runs)."""
    return ray.get_actor(coordinator_actor_name(job), namespace=COORDINATOR_NAMESPACE)


def start_coordinator_actor(
    job: str,
    round_timeout_s: float,
    token: SecretStr,
    journal: Path | Literal["tmp"] | None = "tmp",
    *,
    get_if_exists: bool = False,
    journal_dir: Path | None = None,
    retention: ActorJournalSettings | None = None,
) -> CoordinatorHandle:
    """Start the named coordinator actor for ``job`` on this node.

    Returns at once: the address is known up front (this node, a port chosen
    here), so the workers can start meanwhile; :meth:`CoordinatorHandle.wait_ready`
    waits for it to serve. The actor journals finished rounds to ``journal``
    (``"tmp"``: :func:`default_journal` in ``journal_dir``, a file new to this run;
    None: no journal); it is pinned to this node, so a restarted actor (same
    arguments) finds the file again. ``stop()`` deletes it. A ``"tmp"`` start
    first sweeps that directory of journals older than ``retention``
    (:class:`ActorJournalSettings`, from the environment when None).

    On more than one node the coordinator listens on every interface, over TLS
    with a CA made for this run (:attr:`CoordinatorHandle.ca_cert`).

    ``get_if_exists``: when the job's actor already runs, return a handle to it
    instead (its :meth:`CoordinatorActor.endpoint` is then the truth, not the
    handle's ``target``, token or CA, which describe the actor this call would
    have started).
    """
    if journal == "tmp":
        journal_path: Path | None = default_journal(
            job, secrets.token_hex(_RUN_ID_BYTES), journal_dir
        )
        assert journal_path is not None
        keep_days = (retention or ActorJournalSettings()).journal_retention_days
        # What crashes left on this node goes once it is older than the retention.
        sweep_journals(journal_path.parent, keep_days * 86_400.0)
    else:
        journal_path = journal
    name = coordinator_actor_name(job)
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
        namespace=COORDINATOR_NAMESPACE,
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
    job: str,
    *,
    round_timeout_s: float,
    startup_timeout_s: float,
    journal_dir: Path | None = None,
) -> JoinedCoordinator:
    """The endpoint of ``job``'s coordinator actor on this process's Ray cluster,
    started here (on this node, with a fresh token, over TLS when the cluster has
    several nodes) unless a peer started it first.

    Every rank of a job calls this; Ray's ``get_if_exists`` makes exactly one of
    them create the actor, and all of them read the same endpoint from it. The
    actor is not detached: it lives while the process that created it does and
    some rank holds the returned handle, in the Ray namespace
    :data:`COORDINATOR_NAMESPACE` (so ranks that are Ray drivers of their own meet
    too). It journals to ``journal_dir`` (default: the node's temp dir).

    The journal goes when the process that created the actor calls
    :meth:`JoinedCoordinator.close` or exits cleanly (normal exit, ``sys.exit``,
    SIGTERM, ``ray.actor.exit_actor``), or when the actor ends gracefully; a
    process killed outright (a crash, or Ray ending the job's actors) leaves it
    to the retention sweep (:class:`ActorJournalSettings`). Raises
    :class:`~lossreduce.errors.UsageError` outside a Ray cluster.
    """
    if not ray.is_initialized():
        raise UsageError(
            f"job {job!r}: normalizer='coordinator' without a coordinator address starts or "
            "joins the job's coordinator actor on its Ray cluster, but this process is not "
            "connected to one; pass coordinator=HOST:PORT (LOSSREDUCE_COORDINATOR)"
        )
    fresh = SecretStr(secrets.token_urlsafe(32))
    handle = start_coordinator_actor(
        job, round_timeout_s, fresh, get_if_exists=True, journal_dir=journal_dir
    )
    try:
        endpoint: CoordinatorEndpoint = ray.get(
            handle.actor.endpoint.remote(), timeout=startup_timeout_s
        )
    except GetTimeoutError as err:
        raise UsageError(
            f"job {job!r}: the coordinator actor {handle.name!r} did not answer within "
            f"{startup_timeout_s:g} s"
        ) from err
    # The actor carries the token of the call that created it: this one's, if its own.
    created = secrets.compare_digest(endpoint.token.get_secret_value(), fresh.get_secret_value())
    if not created or handle.journal is None:
        return JoinedCoordinator(endpoint, handle.actor)
    # This process owns the actor: its clean exit removes the journal.
    _OWNED_JOURNALS.add(handle.journal)
    return JoinedCoordinator(endpoint, handle.actor, handle.journal)
