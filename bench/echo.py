"""The ``bare-echo`` reference of ``lossreduce bench``: grpc.aio's own floor.

A servicer of the coordinator's service that answers each request at once,
with no rounds, validation, journal or metrics: each ``ReduceRequest`` gets a
``ReduceResponse`` naming the same round and echoing its partials as
normalizers. Driven by the same load as the coordinator, its CPU per message
and its latency are what grpc.aio itself costs on this machine, so the
coordinator is measured against them. It runs in its own process, like
``lossreduce serve``, with the same cycle-collector tuning, and answers the
health check the bench waits on.

    python -m lossreduce.bench.echo --port 50070
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lossreduce.ports import LOOPBACK
from lossreduce.server.app import quiet_collector
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["ECHO_MODULE", "EchoServicer", "echo", "main"]

ECHO_MODULE = "lossreduce.bench.echo"
"""Run with ``python -m`` to start the echo server."""


def echo(request: pb.ReduceRequest) -> pb.ReduceResponse:
    """The answer to ``request``: its round, its partials as normalizers."""
    return pb.ReduceResponse(
        round=request.round,
        normalizers=[pb.TermNormalizer(term=p.term, value=p.value) for p in request.partials],
    )


class EchoServicer(pb_grpc.ReductionCoordinatorServicer):  # type: ignore[misc]
    """Answers every ``Reduce`` and every ``ReduceStream`` message at once."""

    async def Reduce(  # noqa: N802 (gRPC method name)
        self, request: pb.ReduceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReduceResponse:
        return echo(request)

    async def ReduceStream(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[pb.ReduceRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReduceResponse]:
        async for request in request_iterator:
            yield echo(request)


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ReductionCoordinatorServicer_to_server(EchoServicer(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{LOOPBACK}:{port}") == 0:
        raise OSError(f"cannot bind the echo server to {LOOPBACK}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    quiet_collector()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {ECHO_MODULE}", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="Loopback port to listen on.")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
