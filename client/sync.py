"""The blocking client: :class:`AsyncReductionClient` driven from the caller's thread.

Training loops are synchronous, so this is the client most engines use. It
owns one event loop but no thread: the thread waiting for an answer runs the
loop itself (see :mod:`lossreduce.client._driver`), so a round costs no thread
hand-off. The logic lives in :mod:`lossreduce.client.aio` only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import TypeVar

from lossreduce.client._driver import LoopDriver, Waitable
from lossreduce.client._wire import closed_error
from lossreduce.client.aio import AsyncReductionClient, ClientState
from lossreduce.client.pending import PendingReduction
from lossreduce.client.settings import ClientSettings
from lossreduce.client.types import PartialValue, RoundResult
from lossreduce.errors import describe_round

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
    steps); the calls share one stream. :meth:`reduce_start` sends a round
    and returns at once, so the caller can compute while the round completes.
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
        run: str = "",
    ) -> None:
        self._client = AsyncReductionClient(
            target,
            job=job,
            group=group,
            rank=rank,
            world_size=world_size,
            settings=settings,
            run=run,
        )
        self._driver = LoopDriver()
        # Orders every start of work on the loop before close()'s shutdown, so
        # the shutdown sees (and ends) all of it.
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
    def run(self) -> str:
        """See :attr:`AsyncReductionClient.run`."""
        return self._client.run

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

    def claim(self, step: int = 0) -> bool:
        """See :meth:`AsyncReductionClient.claim`; blocks for the coordinator's answer."""
        return self._run(self._client.claim(step), step=step)

    def reduce(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """See :meth:`AsyncReductionClient.reduce`; blocks until the round ends.

        The same as ``reduce_start(step, partials, contracts).result()``.
        """
        return self._run(self._client.reduce(step, partials, contracts), step=step)

    def reduce_detailed(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> RoundResult:
        """See :meth:`AsyncReductionClient.reduce_detailed`."""
        return self._run(self._client.reduce_detailed(step, partials, contracts), step=step)

    def reduce_start(
        self,
        step: int,
        partials: Mapping[str, PartialValue],
        contracts: Mapping[str, str] | None = None,
    ) -> PendingReduction:
        """Send this rank's partials for ``step`` and return without waiting for
        the round; :meth:`PendingReduction.result` gives what :meth:`reduce`
        would return (or raises what it would raise).

        Returns once the request is written (or its first attempt failed); the
        answer, and any retry, progresses while a thread waits on this client.
        """
        loop = self._driver.loop
        sent: asyncio.Future[None] = loop.create_future()
        work = self._spawn(self._client.reduce_sending(step, partials, contracts, sent), step)
        # The round ending (in error, say) before the request went out also
        # ends the wait: reduce_sending marks ``sent`` however it ends.
        self._driver.wait(sent, None)
        where = f"{describe_round(self.job, self.group, step)} rank {self.rank}"
        return PendingReduction(
            self._driver, work, functools.partial(self._outcome, work, step), where
        )

    def close(self) -> None:
        """Close the client; calls in flight raise ClientClosedError."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            shutdown = self._driver.spawn(self._shutdown())
        try:
            self._driver.wait(shutdown, None)
            shutdown.result()
        finally:
            self._driver.close()

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
        await self._driver.loop.shutdown_asyncgens()

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

    def _spawn(self, coro: Coroutine[object, object, _T], step: int | None) -> Waitable[_T]:
        with self._lock:
            if not self._stopped:
                return self._driver.spawn(coro)
        # close() has begun; the async client may not be marked closed yet
        # (its _shutdown runs after the lock is released), so say it here.
        coro.close()
        raise closed_error(self.job, self.group, self.rank, step, while_waiting=False)

    def _run(self, coro: Coroutine[object, object, _T], step: int | None) -> _T:
        """Run ``coro`` on the client's loop and block for its result."""
        work = self._spawn(coro, step)
        try:
            self._driver.wait(work, None)
        except BaseException:
            # KeyboardInterrupt in the caller's thread: stop the call too.
            self._driver.cancel(work)
            raise
        return self._outcome(work, step)

    def _outcome(self, work: Waitable[_T], step: int | None) -> _T:
        """The result of finished ``work``; a call that close() cancelled raises
        ClientClosedError."""
        try:
            return work.result()
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            if step is not None and self.state is ClientState.CLOSED:
                raise closed_error(
                    self.job, self.group, self.rank, step, while_waiting=True
                ) from None
            raise
