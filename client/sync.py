"""The blocking client: :class:`AsyncReductionClient` on a private event loop.

Training loops are synchronous, so this is the client most engines use. It
owns one background thread running one event loop; every call is handed to
that loop and the caller's thread blocks on the result. The logic lives in
:mod:`lossreduce.client.aio` only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import TypeVar

from lossreduce.client._wire import closed_error
from lossreduce.client.aio import AsyncReductionClient, ClientState
from lossreduce.client.settings import ClientSettings
from lossreduce.client.types import PartialValue, RoundResult

__all__ = ["ReductionClient"]

_T = TypeVar("_T")

_SHUTDOWN_WAIT_S = 5.0
"""How long close() lets calls in flight finish with ClientClosedError."""


class ReductionClient:
    """One rank's connection to the reduction coordinator (blocking).

    ::

        with ReductionClient(
            "127.0.0.1:50051", job="run-7", group="actor", rank=0, world_size=8
        ) as client:
            normalizers = client.reduce(step, {"pg": tokens})

    Thread-safe: several threads may call reduce() at once (e.g. pipelined
    steps); the calls share one stream.
    """

    def __init__(
        self,
        target: str,
        *,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        settings: ClientSettings | None = None,
    ) -> None:
        self._client = AsyncReductionClient(
            target, job=job, group=group, rank=rank, world_size=world_size, settings=settings
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever,
            name=f"lossreduce-client-{job}-{group}-rank{rank}",
            daemon=True,  # a client the caller forgot to close must not block exit
        )
        self._thread.start()
        # Guards the hand-off to the loop against close() stopping it meanwhile.
        self._lock = threading.Lock()
        self._stopped = False

    def __repr__(self) -> str:
        return repr(self._client).replace(type(self._client).__name__, type(self).__name__, 1)

    @property
    def target(self) -> str:
        return self._client.target

    @property
    def settings(self) -> ClientSettings:
        return self._client.settings

    @property
    def job(self) -> str:
        return self._client.job

    @property
    def group(self) -> str:
        return self._client.group

    @property
    def rank(self) -> int:
        return self._client.rank

    @property
    def world_size(self) -> int:
        return self._client.world_size

    @property
    def state(self) -> ClientState:
        return self._client.state

    def open(self) -> None:
        """Open the channel now rather than on the first reduce()."""
        self._run(self._client.open(), step=None)

    def reduce(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """See :meth:`AsyncReductionClient.reduce`; blocks until the round ends."""
        result = self.reduce_detailed(step, partials, contracts)
        return dict(result.normalizers)

    def reduce_detailed(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> RoundResult:
        """See :meth:`AsyncReductionClient.reduce_detailed`."""
        return self._run(self._client.reduce_detailed(step, partials, contracts), step=step)

    def close(self) -> None:
        """Close the client and stop its thread; waiting calls raise ClientClosedError."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    async def _shutdown(self) -> None:
        await self._client.close()
        # gRPC leaves per-call bookkeeping tasks behind; finish them on this
        # loop, as asyncio.run() would, so none is destroyed while pending.
        # Calls in flight were cancelled by close() and end with ClientClosedError
        # within a few loop iterations; only stragglers are cancelled.
        current = asyncio.current_task()
        leftovers = [task for task in asyncio.all_tasks() if task is not current]
        if leftovers:
            await asyncio.wait(leftovers, timeout=_SHUTDOWN_WAIT_S)
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        await self._loop.shutdown_asyncgens()

    def __enter__(self) -> ReductionClient:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, coro: Coroutine[object, object, _T], step: int | None) -> _T:
        """Run ``coro`` on the client's loop and block for its result."""
        with self._lock:
            future = None if self._stopped else asyncio.run_coroutine_threadsafe(coro, self._loop)
        if future is None:
            # close() has begun; the async client may not be marked closed yet
            # (its _shutdown runs after the lock is released), so say it here.
            coro.close()
            raise closed_error(self.job, self.group, self.rank, step, while_waiting=False)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if step is not None and self.state is ClientState.CLOSED:
                raise closed_error(
                    self.job, self.group, self.rank, step, while_waiting=True
                ) from None
            raise
        except BaseException:
            # KeyboardInterrupt in the caller's thread: stop waiting on the loop too.
            future.cancel()
            raise
