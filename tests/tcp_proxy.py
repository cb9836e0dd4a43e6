"""A loopback TCP forwarder that tests put between a client and a coordinator.

It can *freeze* (keep both sockets open, pass no bytes: a dead peer, not even
HTTP/2 pings answer) and *cut* (abort the connections open now; later ones pass
again: a link that drops and recovers). :meth:`TcpProxy.close` leaves no
transport open, so no ResourceWarning surfaces in a later test's ``gc.collect``.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["TcpProxy"]


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.accepted = 0
        self.frozen = asyncio.Event()
        """Set: bytes are swallowed, both sockets stay open."""
        self.upstream_closed = asyncio.Event()
        """Set once an upstream (coordinator-side) connection has ended."""
        self._server: asyncio.Server | None = None
        self._open: list[asyncio.StreamWriter] = []
        self._every: list[asyncio.StreamWriter] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def _keep(self, writer: asyncio.StreamWriter) -> None:
        self._open.append(writer)
        self._every.append(writer)

    def _accept(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        # Synchronous, so every accepted connection is known the moment it exists: a
        # coroutine callback becomes a task, and one that asyncio.run cancels before
        # its first step leaves its transport open.
        self.accepted += 1
        self._keep(down_writer)
        if self._closing:
            down_writer.close()
            return
        self._tasks.append(asyncio.create_task(self._connect(down_reader, down_writer)))

    async def _connect(
        self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            down_writer.close()
            return
        self._keep(up_writer)
        if self._closing:  # closed while connecting upstream
            up_writer.close()
            down_writer.close()
            return
        self._tasks += [
            asyncio.create_task(self._pump(down_reader, up_writer, None)),
            asyncio.create_task(self._pump(up_reader, down_writer, self.upstream_closed)),
        ]

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        closed: asyncio.Event | None,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if self.frozen.is_set():
                    continue  # swallowed: the peer behind us looks dead
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if closed is not None:
                closed.set()
            writer.close()

    def cut(self) -> None:
        """Abort every connection open now; later ones pass again."""
        writers, self._open = self._open, []
        for writer in writers:
            writer.transport.abort()

    async def close(self) -> None:
        assert self._server is not None
        self._closing = True
        self._server.close()
        for _ in range(3):  # accepts the listener took before it closed reach _accept
            await asyncio.sleep(0)
        self.cut()
        # Connects still under way finish (and see the flag); their pumps end on the abort.
        while pending := [t for t in self._tasks if not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)
        self.cut()
        for writer in self._every:
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
        # Last: from Python 3.12 on it waits for every accepted connection to be closed.
        await self._server.wait_closed()
