"""The node agent: one process per node between its ranks and the coordinator.

Toward the ranks of its node the agent serves the coordinator's own v2
``ReductionCoordinator`` service, so a rank uses the unchanged
:class:`~lossreduce.client.ReductionClient`, pointed at its node's agent.
Upstream it holds one ``ReduceStream`` per job and group
(:class:`~lossreduce.client.aggregator.NodeAggregator`) that carries one
aggregated contribution per round, and forwards ``GetRound``/``ListRounds`` so
``lossreduce status`` works through it.

What a rank receives is the coordinator's own response, error status and
``ErrorInfo`` included, so an error reads the same through an agent as from
the coordinator, and the culprit of a failed round is still named by the
coordinator. The agent answers on its own only where it must:

- a rank that is not local to this agent (``local_ranks``): an
  ``INVALID_ARGUMENT`` naming the rank, the agent and its ranks; the agent
  also sends the coordinator a NaN contribution for that rank, so the round
  is aborted at once for every peer, naming the rank, instead of waiting for
  the round timeout;
- a request for another job or group than the agent's (when it has one);
- a rank re-sending a different contribution for a round (``ALREADY_EXISTS``);
- no answer to be had upstream: ``UNAVAILABLE`` once the retry budget is spent
  (the rank's client retries, and the agent tries again), or the
  coordinator's refusal of the agent's credentials, naming the coordinator.

When the agent has a bearer token it accepts only ranks presenting the same
token (the run's token), so an agent listening beyond loopback is no open
door to the coordinator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import math
import threading
from types import TracebackType
from typing import Any

import grpc
from grpc_status import rpc_status

from lossreduce.client._transport import call_metadata, open_channel, status_of
from lossreduce.client.agent_metrics import AgentMetrics
from lossreduce.client.agent_service import AgentServicer, server_options
from lossreduce.client.agent_settings import AgentSettings
from lossreduce.client.aggregator import NodeAggregator
from lossreduce.contribution import Contribution
from lossreduce.errors import (
    AuthenticationError,
    ConflictingContributionError,
    CoordinatorUnavailableError,
    InvalidPartialError,
    LossReduceError,
    describe_round,
)
from lossreduce.metrics_http import MetricsServer
from lossreduce.status_codec import to_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["AgentSettings", "NodeAgent", "NodeAgentThread"]

_BEARER = "bearer "


class NodeAgent:
    """A node agent on the running event loop.

    ::

        agent = NodeAgent("10.0.0.1:50051", job="run-7", group=None, world_size=8,
                          settings=AgentSettings(local_ranks=(0, 1, 2, 3)))
        await agent.start()          # ranks of this node dial agent.target
        ...
        await agent.stop()

    ``job``, ``group`` and ``world_size`` may be None: the agent then serves any
    job and group (one upstream stream each) and takes the world size from the
    requests. When given, a request for another job or group is refused, and
    ``world_size`` is only the default of the node's :class:`LocalRank` views.
    """

    def __init__(
        self,
        upstream: str,
        *,
        job: str | None = None,
        group: str | None = None,
        world_size: int | None = None,
        settings: AgentSettings | None = None,
    ) -> None:
        self.upstream = upstream
        self.job = job
        self.group = group
        self.world_size = world_size
        self.settings = settings if settings is not None else AgentSettings()
        self.metrics = AgentMetrics(upstream)
        self.metadata = call_metadata(self.settings)
        self._nodes: dict[tuple[str, str], NodeAggregator] = {}
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._metrics_server: MetricsServer | None = None
        self._stopping = False
        self.port = 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.upstream!r}, job={self.job!r}, group={self.group!r}, "
            f"local_ranks={self.settings.local_ranks}, target={self.target!r})"
        )

    @property
    def target(self) -> str:
        """``host:port`` the node's ranks dial (the bound port once started)."""
        return f"{self.settings.host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return None if self._metrics_server is None else self._metrics_server.port

    @property
    def metrics_url(self) -> str | None:
        return None if self._metrics_server is None else self._metrics_server.url

    def _name(self, ranks: tuple[int, ...] | None = None) -> str:
        """``node agent HOST:PORT (local ranks [...])``: how every message names this agent;
        ``ranks`` are those a node learned, where the settings name none."""
        known = self.settings.local_ranks or ranks
        text = "learned from the first round" if known is None else str(list(known))
        return f"node agent {self.target} (local ranks {text})"

    async def start(self) -> None:
        """Bind (``port`` 0 picks one), start serving, and return; raises OSError
        when the address cannot be bound."""
        server = grpc.aio.server(options=server_options(self.settings))
        pb_grpc.add_ReductionCoordinatorServicer_to_server(AgentServicer(self), server)
        address = f"{self.settings.host}:{self.settings.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:  # how grpc reports a failed bind
            port = 0
        if port == 0:
            raise OSError(f"cannot bind the node agent to {address} (address in use?)")
        self.port = port
        if self.settings.metrics_port is not None:
            self._metrics_server = MetricsServer(
                self.metrics.registry,
                self.settings.host,
                self.settings.metrics_port,
                name="lossreduce-agent-metrics",
            )
        self._channel = open_channel(self.upstream, self.settings)
        await server.start()
        self._server = server

    async def check_upstream(self) -> None:
        """Ask the coordinator for its rounds once, with this agent's credentials,
        waiting up to ``retry_budget_s`` for it to be reachable.

        Raises :class:`AuthenticationError` or :class:`CoordinatorUnavailableError`
        naming the coordinator.
        """
        wait_s = max(self.settings.retry_budget_s, 1.0)
        try:
            await self.upstream_stub().ListRounds(
                pb.ListRoundsRequest(job=self.job or ""),
                timeout=wait_s,
                metadata=self.metadata,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or "no details"
            where = f"{self._name()}: the coordinator at {self.upstream}"
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise AuthenticationError(
                    f"{where} refused the agent's credentials: {code.name}: {details}",
                    job=self.job or "",
                    group=self.group or "",
                ) from None
            raise CoordinatorUnavailableError(
                f"{where} cannot be reached within {wait_s:g} s: {code.name}: {details}",
                job=self.job or "",
                group=self.group or "",
            ) from None

    async def stop(self, grace_s: float | None = None) -> None:
        """Give rounds already upstream ``grace_s`` (default ``shutdown_grace_s``) to be
        answered, then close the upstream streams (ranks still waiting get UNAVAILABLE-
        style errors) and stop serving. Safe to call more than once."""
        if self._stopping:
            return
        self._stopping = True
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        nodes = list(self._nodes.values())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(n.settle() for n in nodes)), grace)
        for node in nodes:
            await node.close()
        if self._server is not None:
            # Let the answers to the rounds closed just now go out.
            await self._server.stop(min(grace, 1.0))
        if self._channel is not None:
            await self._channel.close()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.close)

    # -- what the servicer uses ------------------------------------------------------

    def upstream_stub(self) -> pb_grpc.ReductionCoordinatorStub:
        assert self._channel is not None, "start() opens the upstream channel"
        return pb_grpc.ReductionCoordinatorStub(self._channel)

    def upstream_status(self, exc: grpc.aio.AioRpcError) -> grpc.Status:
        """A failed forwarded call's status, its message naming the coordinator."""
        status = status_of(exc)
        status.message = f"{self._name()}: the coordinator at {self.upstream}: {status.message}"
        return rpc_status.to_status(status)

    async def authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Refuse a caller without this agent's bearer token (when it has one)."""
        if self.settings.token is None:
            return
        expected = self.settings.token.get_secret_value().encode()
        for key, value in context.invocation_metadata() or ():
            if key != "authorization" or not isinstance(value, str):
                continue
            scheme, token = value[: len(_BEARER)], value[len(_BEARER) :].strip()
            if scheme.lower() == _BEARER and hmac.compare_digest(token.encode(), expected):
                return
        self.metrics.request_rejected("", "", "unauthenticated")
        err = AuthenticationError(
            f"{self._name()} accepts only its ranks' bearer token (the run's token, "
            "LOSSREDUCE_TOKEN); the call presented none or another"
        )
        await context.abort_with_status(rpc_status.to_status(to_status(err)))

    async def answer(self, request: pb.ReduceRequest) -> pb.ReduceResponse:
        """What a rank's request gets: the coordinator's response, or the agent's refusal."""
        key = request.round
        c = Contribution.from_request(request)
        refusal = self._refusal(request, c)
        if refusal is not None:
            return pb.ReduceResponse(round=key, error=to_status(refusal))
        node = self._node(key.job, key.group, c.world_size)
        if not node.serves(c.rank):
            return await self._stray(node, request, c)
        learning = node.local_ranks is None
        try:
            (response,) = await node.respond(key.step, [c])
        except ConflictingContributionError as err:
            self.metrics.request_rejected(key.job, key.group, "conflict")
            return pb.ReduceResponse(round=key, error=to_status(err))
        except LossReduceError as err:
            return pb.ReduceResponse(round=key, error=to_status(err))
        if learning and node.local_ranks is not None:
            self.metrics.node_known(key.job, key.group, len(node.local_ranks))
        return response

    def _refusal(self, request: pb.ReduceRequest, c: Contribution) -> LossReduceError | None:
        key = request.round
        where = describe_round(key.job, key.group, key.step)
        common: dict[str, Any] = {
            "job": key.job,
            "group": key.group,
            "step": key.step,
            "rank": c.rank,
        }
        if self._stopping:
            return CoordinatorUnavailableError(
                f"{where} rank {c.rank}: {self._name()} is shutting down", **common
            )
        if (self.job is not None and key.job != self.job) or (
            self.group is not None and key.group != self.group
        ):
            self.metrics.request_rejected(key.job, key.group, "wrong_job")
            serves = f"job {self.job or '(any)'!r} group {self.group or '(any)'!r}"
            return InvalidPartialError(
                f"{where} rank {c.rank}: {self._name()} serves {serves} only; point this "
                "rank at its own job's agent or coordinator",
                **common,
            )
        if c.covers:
            self.metrics.request_rejected(key.job, key.group, "aggregate")
            return InvalidPartialError(
                f"{where} rank {c.rank}: {self._name()} takes one rank's contribution per "
                f"request, not an aggregate covering ranks {list(c.covers)}",
                **common,
            )
        return None

    def _node(self, job: str, group: str, world_size: int) -> NodeAggregator:
        node = self._nodes.get((job, group))
        if node is None:
            node = self._nodes[(job, group)] = NodeAggregator(
                self.upstream,
                job=job,
                group=group,
                local_ranks=self.settings.local_ranks,
                world_size=self.world_size or max(world_size, 1),
                settings=self.settings,
                observer=self.metrics,
            )
            self.metrics.group_started(job, group)
            self.metrics.node_known(job, group, len(node.local_ranks or ()))
        return node

    async def _stray(
        self, node: NodeAggregator, request: pb.ReduceRequest, c: Contribution
    ) -> pb.ReduceResponse:
        """A rank that reached the wrong node's agent."""
        key = request.round
        self.metrics.request_rejected(key.job, key.group, "wrong_node")
        # The rank's round cannot complete without it, and its own agent waits for it
        # in vain: a NaN contribution in its name aborts the round for every peer at
        # once, naming this rank. (Had its real contribution already reached the
        # coordinator, this one only gets a conflict, and the round stands.)
        poisoned = dataclasses.replace(c, values=tuple(math.nan for _ in c.terms))
        await node.forward_alone(poisoned.request(key))
        err = InvalidPartialError(
            f"{describe_round(key.job, key.group, key.step)} rank {c.rank}: rank {c.rank} is "
            f"not a local rank of {self._name(node.local_ranks)}; point it at its own node's "
            "agent (its round is aborted for every rank, naming it)",
            job=key.job,
            group=key.group,
            step=key.step,
            rank=c.rank,
            ranks=(c.rank,),
        )
        return pb.ReduceResponse(round=key, error=to_status(err))


class NodeAgentThread:
    """A :class:`NodeAgent` on its own event loop in a background thread, for
    blocking callers (a Ray actor, tests)::

        with NodeAgentThread(upstream, job=job, group=None, world_size=8,
                             settings=AgentSettings(local_ranks=(0, 1))) as agent:
            client = ReductionClient(agent.target, job=job, group="actor", rank=0, world_size=8)
    """

    def __init__(
        self,
        upstream: str,
        *,
        job: str | None = None,
        group: str | None = None,
        world_size: int | None = None,
        settings: AgentSettings | None = None,
    ) -> None:
        self.agent = NodeAgent(
            upstream, job=job, group=group, world_size=world_size, settings=settings
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def target(self) -> str:
        return self.agent.target

    @property
    def port(self) -> int:
        return self.agent.port

    @property
    def metrics_port(self) -> int | None:
        return self.agent.metrics_port

    @property
    def metrics_url(self) -> str | None:
        return self.agent.metrics_url

    def start(self) -> NodeAgentThread:
        """Start the thread and return once the agent serves (or raise why not)."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("The node agent thread was already started.")
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name="lossreduce-node-agent", daemon=True
            )
            self._loop, self._thread = loop, thread
            thread.start()
        try:
            self._call(self.agent.start())
        except BaseException:
            self._end_loop()
            raise
        return self

    def check_upstream(self) -> None:
        """See :meth:`NodeAgent.check_upstream`."""
        self._call(self.agent.check_upstream())

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the agent (see :meth:`NodeAgent.stop`) and join the thread."""
        with self._lock:
            if self._loop is None:
                return
        try:
            self._call(self.agent.stop(grace_s))
        finally:
            self._end_loop()

    def _call(self, coro: Any) -> Any:
        assert self._loop is not None, "start() runs the loop"
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def _end_loop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return

        async def leftovers() -> None:
            # gRPC leaves per-call bookkeeping tasks behind; finish them as asyncio.run would.
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.shutdown_asyncgens()

        asyncio.run_coroutine_threadsafe(leftovers(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def __enter__(self) -> NodeAgentThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
