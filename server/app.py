"""Running a coordinator: the gRPC server, health, reflection, metrics, shutdown.

:func:`start` builds one running :class:`Coordinator` on the current event
loop; :func:`serve` runs one until SIGTERM/SIGINT (``lossreduce serve``);
:class:`CoordinatorThread` runs one on a private loop in a background thread
for synchronous callers (tests, the Ray coordinator actor, the benchmark).

Shutdown, in order: health turns NOT_SERVING, new rounds get UNAVAILABLE,
rounds in flight get ``shutdown_grace_s`` to complete, the rest are answered
UNAVAILABLE, then the server stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import signal
import threading
from collections.abc import Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lossreduce.v2 import coordinator_pb2, coordinator_pb2_grpc

from .hardening import Hardening, harden
from .metrics import CoordinatorMetrics, MetricsServer
from .outcomes import OutcomeStore
from .round_table import RoundTable
from .servicer import CoordinatorServicer
from .settings import CoordinatorSettings

__all__ = ["SERVICE_NAME", "Coordinator", "CoordinatorThread", "quiet_collector", "serve", "start"]

SERVICE_NAME: str = coordinator_pb2.DESCRIPTOR.services_by_name["ReductionCoordinator"].full_name
"""``lossreduce.v2.ReductionCoordinator``: the health service reports it and ``""``."""

_SWEEP_INTERVAL_S = 5.0


def _server_options(settings: CoordinatorSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        # Without this, an unanswered ping only fails after gRPC's 60 s default.
        ("grpc.http2.ping_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Workers ping an idle stream between steps; do not punish them for it.
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            int(settings.keepalive_min_ping_interval_s * 1000),
        ),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


class Coordinator:
    """One running coordinator on the current event loop; build it with :func:`start`."""

    def __init__(
        self,
        *,
        settings: CoordinatorSettings,
        server: grpc.aio.Server,
        servicer: CoordinatorServicer,
        table: RoundTable,
        health_servicer: health.aio.HealthServicer,
        metrics: CoordinatorMetrics,
        metrics_server: MetricsServer | None,
        port: int,
    ) -> None:
        self.settings = settings
        self.server = server
        self.servicer = servicer
        self.table = table
        self.health = health_servicer
        self.metrics = metrics
        self._metrics_server = metrics_server
        self.port = port
        self._sweeper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._stopping = False
        self.hardening = Hardening()
        """Tokens, TLS and the journal of this coordinator; the journal closes at stop."""

    @property
    def target(self) -> str:
        """``host:port`` clients dial (the actual bound port)."""
        return f"{self.settings.host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return None if self._metrics_server is None else self._metrics_server.port

    @property
    def metrics_url(self) -> str | None:
        return None if self._metrics_server is None else self._metrics_server.url

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(_SWEEP_INTERVAL_S, self.settings.round_timeout_s))
            self.servicer.sweep()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop (see the module docstring); safe to call more than once."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        try:
            for service in ("", SERVICE_NAME):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.servicer.drain(grace)
            # Let the answers to aborted rounds go out before connections close.
            await self.server.stop(1.0)
        finally:
            if self._sweeper is not None:
                self._sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._sweeper
            if self._metrics_server is not None:
                await asyncio.to_thread(self._metrics_server.close)
            self.hardening.close()
            self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def start(
    settings: CoordinatorSettings,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    store: OutcomeStore | None = None,
) -> Coordinator:
    """Start a coordinator on the running loop and return once it is SERVING.

    ``interceptors`` wrap every RPC (authentication, request ids); ``store``
    persists finished outcomes before any rank sees them.
    """
    # Tokens, TLS, the binding rule and the journal (server/hardening.py).
    hardening = harden(settings, store=store)
    metrics = CoordinatorMetrics()
    table = RoundTable(
        settings, observer=metrics, store=hardening.store, claim_store=hardening.claim_store
    )
    servicer = CoordinatorServicer(table, metrics, timeout_s=settings.round_timeout_s)
    server = grpc.aio.server(
        interceptors=[*hardening.interceptors, *interceptors], options=_server_options(settings)
    )
    coordinator_pb2_grpc.add_ReductionCoordinatorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{settings.host}:{settings.port}"
    try:
        if hardening.credentials is not None:
            port = server.add_secure_port(address, hardening.credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # how grpc reports a failed bind
        port = 0
    if port == 0:
        hardening.close()
        raise OSError(f"cannot bind the coordinator to {address} (address in use?)")
    metrics_server = None
    try:
        if settings.metrics_port is not None:
            metrics_server = MetricsServer(metrics.registry, settings.host, settings.metrics_port)
        await server.start()
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if metrics_server is not None:
            metrics_server.close()
        await server.stop(None)
        hardening.close()
        raise
    coordinator = Coordinator(
        settings=settings,
        server=server,
        servicer=servicer,
        table=table,
        health_servicer=health_servicer,
        metrics=metrics,
        metrics_server=metrics_server,
        port=port,
    )
    coordinator.hardening = hardening
    coordinator._sweeper = asyncio.create_task(coordinator._sweep_forever())
    return coordinator


async def serve(
    settings: CoordinatorSettings,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    store: OutcomeStore | None = None,
    ready: asyncio.Future[Coordinator] | None = None,
) -> None:
    """Run a coordinator until SIGTERM or SIGINT, then drain and stop it.

    ``ready`` (optional) receives the running coordinator, e.g. to print its address.
    """
    coordinator = await start(settings, interceptors=interceptors, store=store)
    quiet_collector()
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    if ready is not None:
        ready.set_result(coordinator)
    try:
        await stop_requested.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await coordinator.stop()


def quiet_collector() -> None:
    """Tune the cycle collector for a process that only serves rounds.

    Profiling ``lossreduce serve`` at N=256 showed ~7% of its CPU in the cycle
    collector, triggered by per-message allocations that reference counting
    frees anyway. Freezing what start-up built (modules, the server) and
    collecting the young generation 20x less often cut server CPU per
    contribution by about 10% in the benchmark (docs/performance.md).
    Only the ``serve`` entry point does this: it owns the process.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


class CoordinatorThread:
    """A real coordinator on its own event loop in a background thread.

    ::

        with CoordinatorThread(CoordinatorSettings(port=0, metrics_port=0)) as coord:
            channel = grpc.insecure_channel(coord.target)

    Attributes once started: ``target`` (``"127.0.0.1:PORT"``), ``port``,
    ``metrics_port`` and ``metrics_url`` (None when metrics are off), and
    ``coordinator`` (not thread-safe: only touch it from its own event loop).
    """

    def __init__(
        self,
        settings: CoordinatorSettings | None = None,
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        store: OutcomeStore | None = None,
    ) -> None:
        self.settings = settings if settings is not None else CoordinatorSettings(port=0)
        self._interceptors = tuple(interceptors)
        self._store = store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._coordinator: Coordinator | None = None
        self._stop_requested: asyncio.Event | None = None
        self._stop_lock = threading.Lock()
        self._stop_asked = False
        self._grace_s: float | None = None
        self._stop_error: Exception | None = None

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("The coordinator thread is not running; call start() first.")
        return self._coordinator

    @property
    def target(self) -> str:
        return self.coordinator.target

    @property
    def port(self) -> int:
        return self.coordinator.port

    @property
    def metrics_port(self) -> int | None:
        return self.coordinator.metrics_port

    @property
    def metrics_url(self) -> str | None:
        return self.coordinator.metrics_url

    def start(self) -> CoordinatorThread:
        """Start the thread and return once the coordinator is SERVING (or raise why not)."""
        if self._thread is not None:
            raise RuntimeError("The coordinator thread was already started.")
        self._stop_asked, self._grace_s = False, None
        loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[Coordinator] = concurrent.futures.Future()
        thread = threading.Thread(
            target=self._run, args=(loop, ready), name="lossreduce-coordinator", daemon=True
        )
        self._loop, self._thread = loop, thread
        thread.start()
        try:
            self._coordinator = ready.result()
        except BaseException:
            thread.join()
            self._loop = self._thread = None
            raise
        return self

    def _run(
        self, loop: asyncio.AbstractEventLoop, ready: concurrent.futures.Future[Coordinator]
    ) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(ready))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self, ready: concurrent.futures.Future[Coordinator]) -> None:
        try:
            coordinator = await start(
                self.settings, interceptors=self._interceptors, store=self._store
            )
        except BaseException as exc:
            ready.set_exception(exc)
            return
        stop_requested = self._stop_requested = asyncio.Event()
        ready.set_result(coordinator)
        # Stopped by stop() (a request set on this loop) or by a stop() awaited here.
        waits = [
            asyncio.ensure_future(stop_requested.wait()),
            asyncio.ensure_future(coordinator.wait_stopped()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        try:
            await coordinator.stop(self._grace_s)  # returns at once if already stopped
        except Exception as exc:
            self._stop_error = exc

    def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop the coordinator (``grace_s`` defaults to the setting), join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        request = self._stop_requested
        if request is not None:
            with self._stop_lock:
                if not self._stop_asked:
                    self._stop_asked, self._grace_s = True, grace_s
            # A plain callback, not a coroutine: a loop that already ended (another
            # stop() got there first) may close without running it, harmlessly.
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(request.set)
        # The thread ends once the coordinator has stopped.
        thread.join()
        self._loop = self._thread = None
        error, self._stop_error = self._stop_error, None
        if error is not None:
            raise error

    def __enter__(self) -> CoordinatorThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
