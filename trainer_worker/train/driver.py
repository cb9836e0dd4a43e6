"""The training driver: Ray, the coordinator, placement, node agents, outputs.

What trains on the workers is the engine of ``--engine``, looked up in
:mod:`~lossreduce.trainer_worker.train.engines.registry` and driven through
:class:`~lossreduce.trainer_worker.train.engines.base.Engine`: the driver
never names one. It builds the engine before Ray starts (bad input costs
nothing), starts Ray, the coordinator actor, the placement group and the node
agents, hands the engine its :class:`WorkerCluster`, and records every step
the engine reports (progress bar, ``metrics.jsonl``, plot).

Failures (a dead, failing or hung rank, a cluster that cannot hold the
workers) end the run with :class:`TrainingFailedError`, whose message names
the rank and its node (see :mod:`lossreduce.trainer_worker.train.worker_group`).
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from pydantic import SecretStr
from ray.exceptions import GetTimeoutError, RayActorError
from rich.console import Console

from lossreduce._compat import UTC
from lossreduce.client import ClientSettings
from lossreduce.errors import UsageError
from lossreduce.server.security import is_loopback
from lossreduce.trainer_worker.integrations.coordinator_actor import (
    CoordinatorHandle,
    start_coordinator_actor,
)
from lossreduce.trainer_worker.integrations.run_identity import draw_run
from lossreduce.trainer_worker.integrations.tls import read_ca
from lossreduce.trainer_worker.train.engines.base import REDUCTION_GROUP, Engine, WorkerCluster
from lossreduce.trainer_worker.train.engines.registry import get_engine
from lossreduce.trainer_worker.train.outputs import RunOutputs, StepObserver, StepRecord
from lossreduce.trainer_worker.train.placement import WorkerPlacement, create_worker_placement
from lossreduce.trainer_worker.train.ray_start import (
    LOCAL_START_ATTEMPTS,
    reap_ray_processes,
    start_timed_out,
)
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VerifyReport
from lossreduce.trainer_worker.train.worker_group import (
    TrainingFailedError,
    death_reason,
    short_error,
)

if TYPE_CHECKING:
    from lossreduce.trainer_worker.train.agent_actor import NodeAgents

__all__ = ["RunResult", "StepObserver", "TrainingFailedError", "default_out_dir", "run"]

STARTUP_TIMEOUT_S = 120.0
"""Bound on placing the workers, starting them and the coordinator."""


@dataclass(frozen=True)
class RunResult:
    """What a finished run produced."""

    job: str
    out_dir: Path
    records: tuple[StepRecord, ...]
    verify: VerifyReport | None
    run: str
    """The run id every worker's rounds carried."""


_LOG = logging.getLogger(__name__)

RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
"""How Ray's notice begins that a new local cluster turned its token authentication on
by default (logged by :data:`_RAY_AUTH_LOGGER` on every local ``ray.init``)."""
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropLocalTokenNotice(logging.Filter):
    """Drops exactly :data:`RAY_TOKEN_NOTICE`: for the single-user cluster this run
    starts and ends itself, token authentication on is the intended state, not a
    warning. Security is Ray's default either way; nothing else Ray logs is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_TOKEN_NOTICE)


@contextmanager
def _quiet_local_start() -> Iterator[None]:
    notice = _DropLocalTokenNotice()
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


@contextmanager
def _ray_session(settings: TrainSettings) -> Iterator[bool]:
    """Join or start Ray; shut down only what this run started.

    Yields whether this run started a local cluster (whose size is then final).
    """
    if ray.is_initialized():
        yield False
        return
    try:
        if settings.address is None:
            _start_local_ray(settings)
        else:
            # Joining a real cluster: whatever Ray says of its authentication is shown.
            _check_reachable(settings.address)
            ray.init(address=settings.address, logging_level="WARNING")
    except Exception as err:
        # Ray raises a bare Exception when a raylet misses its 30 s registration window
        # (an overloaded machine); anything else Ray raises here is as much the run's end.
        # What a failed start spawned is not left running.
        ray.shutdown()
        reap_ray_processes()
        where = f"--address {settings.address}" if settings.address else "a local Ray cluster"
        raise TrainingFailedError(f"cannot start or join {where}: {short_error(err)}") from err
    try:
        yield settings.address is None
    finally:
        ray.shutdown()


def _start_local_ray(settings: TrainSettings) -> None:
    """A local Ray cluster of this run's own; a start that was only too slow (a loaded
    machine: a raylet that missed Ray's fixed registration window, a GCS whose port
    came late) is torn down, its processes reaped, and tried again."""
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with _quiet_local_start():
                # address="local": a cluster of this run's own, even where another Ray
                # cluster runs on this machine (plain ray.init() would join that one).
                ray.init(
                    address="local",
                    num_cpus=settings.num_cpus,
                    include_dashboard=False,
                    logging_level="WARNING",
                )
            return
        except Exception as err:  # a bare Exception (raylet) or RuntimeError (GCS)
            ray.shutdown()
            reap_ray_processes()
            if attempt == LOCAL_START_ATTEMPTS or not start_timed_out(err):
                raise
            _LOG.warning(
                "a local Ray start timed out (%s); trying again (%d/%d)",
                short_error(err),
                attempt + 1,
                LOCAL_START_ATTEMPTS,
            )


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` Ray address must accept a TCP connection (Ray itself retries
    for minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(f"nothing answers at {address} ({err})") from err


def _check_capacity(settings: TrainSettings) -> None:
    """Fail at once when a local cluster can never hold the workers' bundles."""
    resources = ray.cluster_resources()
    kind = "GPU" if resources.get("GPU", 0.0) >= 1.0 else "CPU"
    have = int(resources.get(kind, 0.0))
    if have < settings.workers:
        raise TrainingFailedError(
            f"--workers {settings.workers} needs {settings.workers} {kind} bundles, but the "
            f"local Ray cluster has {have} {kind}s (raise --num-cpus or lower --workers)"
        )


def aggregates(settings: TrainSettings, placement: WorkerPlacement) -> bool:
    """Whether the run uses node agents: ``--aggregation node``, or ``auto`` over many nodes."""
    if settings.normalizer != "coordinator" or settings.aggregation == "off":
        return False
    return settings.aggregation == "node" or len({s.node_id for s in placement.slots}) > 1


def _check_reachable_from_every_node(settings: TrainSettings, placement: WorkerPlacement) -> None:
    """A loopback ``--coordinator`` is this node's only: ranks and agents elsewhere miss it."""
    if settings.coordinator is None:
        return
    nodes = {s.node_id for s in placement.slots}
    host = settings.coordinator.rpartition(":")[0]
    if len(nodes) > 1 and is_loopback(host):
        raise TrainingFailedError(
            f"--coordinator {settings.coordinator} is a loopback address, but the {settings.workers} "
            f"workers span {len(nodes)} nodes, whose ranks and agents would each dial their own "
            "node; give an address every node reaches (e.g. this node's IP)"
        )


def _start_agents(
    settings: TrainSettings,
    job: str,
    placement: WorkerPlacement,
    *,
    upstream: str,
    token: SecretStr | None,
    tls_ca: bytes | None,
) -> NodeAgents:
    """The node agents, upstream to the coordinator with the run's credentials."""
    # Imported here: a run without agents (one node, the torch normalizer) needs none of it.
    from lossreduce.client.agent import AgentSettings
    from lossreduce.trainer_worker.train.agent_actor import start_node_agents

    agent_settings = AgentSettings(
        call_timeout_s=settings.round_timeout_s + 30,
        # Below the round timeout, so that the coordinator's timeout names only the ranks
        # that never came (the agent forwards late ones as they come).
        node_timeout_s=settings.round_timeout_s / 2,
        token=token,
        tls_root_cert_pem=tls_ca,
    )
    try:
        return start_node_agents(
            placement.slots,
            upstream,
            job=job,
            group=REDUCTION_GROUP,
            settings=agent_settings,
            timeout_s=STARTUP_TIMEOUT_S,
        )
    except RuntimeError as err:
        raise TrainingFailedError(str(err)) from err


def _describe_run(
    settings: TrainSettings,
    job: str,
    placement: WorkerPlacement,
    *,
    target: str | None,
    tls_ca: bytes | None,
    agents: NodeAgents | None,
    engine: Engine,
) -> str:
    """The run's first line: who trains where, and how the normalizers travel
    (the engine adds what is its own)."""
    # A default job already ends in the run; a given one does not show it.
    run = "" if job.endswith(f"-{settings.run}") else f" (run {settings.run})"
    nodes = len({s.node_id for s in placement.slots})
    line = (
        f"lossreduce train --engine {settings.engine}: job {job!r}{run}, "
        f"{settings.workers} workers "
        f"({'GPU' if placement.use_gpu else 'CPU'}, {settings.placement}, "
        f"{nodes} node{'s' if nodes > 1 else ''}), normalizer {settings.normalizer}"
    )
    if settings.normalizer == "coordinator":
        line += f" at {target}{' over TLS' if tls_ca is not None else ''}"
    if agents is not None:
        line += f" through {len(agents.actors)} node agents"
    return f"{line}, {engine.describe()}"


def _wait_ready(coordinator: CoordinatorHandle | None) -> None:
    """Wait for the embedded coordinator actor to serve (no-op without one)."""
    if coordinator is None:
        return
    try:
        coordinator.wait_ready(STARTUP_TIMEOUT_S)
    except (RayActorError, GetTimeoutError) as err:
        raise TrainingFailedError(
            f"the coordinator actor {coordinator.name} did not start: {death_reason(err)}"
        ) from err


def default_out_dir(now: datetime | None = None) -> Path:
    """``runs/<UTC timestamp>``."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stamp


def _build_engine(settings: TrainSettings, job: str, out_dir: Path) -> Engine:
    """The run's engine, built before Ray starts: a framework that is missing or
    untested, or a checkpoint that does not load, fails here."""
    spec = get_engine(settings.engine)
    try:
        factory = spec.load()
    except ImportError as err:
        raise TrainingFailedError(f"--engine {spec.name}: {err}") from err
    try:
        return factory(settings, job, out_dir)
    except UsageError as err:
        raise TrainingFailedError(str(err)) from err


def run(
    settings: TrainSettings,
    *,
    console: Console | None = None,
    observers: Sequence[StepObserver] = (),
) -> RunResult:
    """Run training (or ``--verify``) end to end; raise :class:`TrainingFailedError` on failure.

    A bad ``LOSSREDUCE_*`` variable the engine's workers would read raises
    :class:`~lossreduce.errors.ReductionConfigError` naming it, before Ray starts.
    """
    get_engine(settings.engine).check_environment(settings)
    console = console or Console()
    now = datetime.now(UTC)
    # One draw for the whole run: every worker gets it in its settings, so all ranks
    # (and ranks Ray restarts) reduce under the same run.
    run_id = settings.run or draw_run()
    settings = settings.model_copy(update={"run": run_id})
    job = settings.job or f"train-{run_id}"
    out_dir = settings.out or default_out_dir(now)
    engine = _build_engine(settings, job, out_dir)
    with _ray_session(settings) as started_local:
        coordinator: CoordinatorHandle | None = None
        placement: WorkerPlacement | None = None
        agents: NodeAgents | None = None
        failed = True
        try:
            target = settings.coordinator
            # An external coordinator takes the operator's token ($LOSSREDUCE_TOKEN)
            # and --tls-ca; the embedded one a fresh token and CA of this run.
            token = ClientSettings().token if target is not None else None
            try:
                tls_ca = None if settings.tls_ca is None else read_ca(settings.tls_ca)
            except UsageError as err:
                raise TrainingFailedError(str(err)) from err
            if settings.normalizer == "coordinator" and target is None:
                token = SecretStr(secrets.token_urlsafe(32))
                coordinator = start_coordinator_actor(job, settings.round_timeout_s, token)
                target, tls_ca = coordinator.target, coordinator.ca_cert
            if started_local:
                _check_capacity(settings)
            try:
                placement = create_worker_placement(
                    settings.workers, settings.placement, STARTUP_TIMEOUT_S
                )
            except TimeoutError as err:
                raise TrainingFailedError(f"--placement {settings.placement}: {err}") from err
            _check_reachable_from_every_node(settings, placement)
            targets: list[str | None] = [target] * settings.workers
            cas = [tls_ca] * settings.workers
            if target is not None and aggregates(settings, placement):
                # Agents connect upstream at start: the coordinator serves first.
                _wait_ready(coordinator)
                agents = _start_agents(
                    settings, job, placement, upstream=target, token=token, tls_ca=tls_ca
                )
                # Ranks reach their node's agent over loopback: plaintext, same token.
                targets = [agents.target_of(rank) for rank in range(settings.workers)]
                cas = [None] * settings.workers
            engine.start(
                WorkerCluster(
                    placement,
                    targets,
                    token,
                    cas,
                    failure_notes=agents.dead if agents is not None else tuple,
                )
            )
            _wait_ready(coordinator)
            console.print(
                _describe_run(
                    settings,
                    job,
                    placement,
                    target=target,
                    tls_ca=tls_ca,
                    agents=agents,
                    engine=engine,
                ),
                highlight=False,
            )
            if settings.verify:
                report = engine.verify()
                console.print(report.table())
                failed = False
                return RunResult(job, out_dir, (), report, run_id)
            with RunOutputs(
                out_dir, settings.steps, progress=settings.progress, console=console
            ) as outputs:
                engine.train([outputs, *observers])
            outputs.finish()
            failed = False
            return RunResult(job, out_dir, tuple(outputs.records), None, run_id)
        finally:
            try:
                engine.shutdown(graceful=not failed)
            finally:
                try:
                    if agents is not None:
                        agents.stop()
                    if placement is not None:
                        placement.remove()
                finally:
                    if coordinator is not None:
                        coordinator.stop()
