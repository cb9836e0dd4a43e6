"""The coordinator's v2 service as a node agent answers it: the gRPC adapter
around the agent's own logic (:class:`AgentCore`, which
:class:`~lossreduce.client.agent.NodeAgent` implements).

``Reduce`` and ``ReduceStream`` hand every request to the agent and answer in
request order, as the coordinator does; ``GetRound``, ``ListRounds`` and
``Claim`` are forwarded upstream with the agent's own credentials.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from google.rpc import code_pb2
from grpc_status import rpc_status

from lossreduce.client.agent_settings import AgentSettings
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["AgentCore", "AgentServicer", "server_options"]


class AgentCore(Protocol):
    """What the service needs of a node agent."""

    @property
    def metadata(self) -> Sequence[tuple[str, str]]:
        """The agent's own credentials, sent upstream."""

    async def authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Abort the call unless it presents the run's token."""

    async def answer(self, request: pb.ReduceRequest) -> pb.ReduceResponse:
        """The response for one rank's request."""

    def upstream_stub(self) -> pb_grpc.ReductionCoordinatorStub:
        """A stub on the agent's channel to the coordinator."""

    def upstream_status(self, exc: grpc.aio.AioRpcError) -> grpc.Status:
        """The status a forwarded call's failure is answered with."""


def server_options(settings: AgentSettings) -> list[tuple[str, int]]:
    """The agent's gRPC server options (message limits, keepalive from its ranks)."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        # Ranks ping their idle stream between steps (ClientSettings.keepalive_time_s).
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


class AgentServicer(pb_grpc.ReductionCoordinatorServicer):  # type: ignore[misc]
    """The coordinator's service, answered by a :class:`NodeAgent`."""

    def __init__(self, agent: AgentCore) -> None:
        self._agent = agent

    async def Reduce(  # noqa: N802 (gRPC method name)
        self, request: pb.ReduceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReduceResponse:
        await self._agent.authorize(context)
        response = await self._agent.answer(request)
        if response.error.code != code_pb2.OK:
            await context.abort_with_status(rpc_status.to_status(response.error))
        return response

    async def ReduceStream(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[pb.ReduceRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReduceResponse]:
        await self._agent.authorize(context)
        # Requests are taken as they arrive (a rank may pipeline several steps) and
        # answered strictly in request order, as the coordinator does.
        pending: asyncio.Queue[asyncio.Task[pb.ReduceResponse] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    pending.put_nowait(asyncio.create_task(self._agent.answer(request)))
            finally:
                pending.put_nowait(None)

        reader = asyncio.create_task(read())
        answers: list[asyncio.Task[pb.ReduceResponse]] = []
        try:
            while (task := await pending.get()) is not None:
                answers.append(task)
                yield await task
                answers.remove(task)
        finally:
            reader.cancel()
            # A rank that went away: its contributions stay in their rounds.
            for task in answers:
                task.cancel()
            await asyncio.gather(reader, *answers, return_exceptions=True)

    async def GetRound(  # noqa: N802 (gRPC method name)
        self, request: pb.GetRoundRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RoundStatus:
        status: pb.RoundStatus = await self._forward("GetRound", request, context)
        return status

    async def ListRounds(  # noqa: N802 (gRPC method name)
        self, request: pb.ListRoundsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListRoundsResponse:
        rounds: pb.ListRoundsResponse = await self._forward("ListRounds", request, context)
        return rounds

    async def Claim(  # noqa: N802 (gRPC method name)
        self, request: pb.ClaimRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClaimResponse:
        claimed: pb.ClaimResponse = await self._forward("Claim", request, context)
        return claimed

    async def _forward(
        self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        """Ask the coordinator with the agent's credentials, within the caller's deadline."""
        await self._agent.authorize(context)
        call = getattr(self._agent.upstream_stub(), method)
        try:
            return await call(
                request, timeout=context.time_remaining(), metadata=self._agent.metadata
            )
        except grpc.aio.AioRpcError as exc:
            await context.abort_with_status(self._agent.upstream_status(exc))
            raise  # abort_with_status raises; this only tells mypy
