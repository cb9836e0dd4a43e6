"""A round started by :meth:`lossreduce.client.ReductionClient.reduce_start`.

The request is on its way when the handle is returned; the caller computes
(e.g. the forward pass) and calls :meth:`PendingReduction.result` when it
needs the normalizers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from lossreduce.client._driver import LoopDriver, Waitable

__all__ = ["PendingReduction"]


class PendingReduction:
    """One rank's round in flight; ``result()`` is what ``reduce()`` would give.

    Thread-safe. Waiting (in :meth:`result`) is what lets the answer, and any
    retry, progress: the client has no thread of its own.
    """

    def __init__(
        self,
        driver: LoopDriver,
        work: Waitable[dict[str, float]],
        outcome: Callable[[], dict[str, float]],
        where: str,
    ) -> None:
        self._driver = driver
        self._work = work
        self._outcome = outcome
        self._where = where

    def __repr__(self) -> str:
        state = "done" if self._work.done() else "pending"
        return f"PendingReduction({self._where}, {state})"

    def result(self, timeout: float | None = None) -> dict[str, float]:
        """Term -> global normalizer, blocking until the round ends.

        Raises what :meth:`lossreduce.client.ReductionClient.reduce` would raise,
        on every call; :class:`TimeoutError` if ``timeout`` seconds pass first
        (the round goes on; call again); :class:`concurrent.futures.CancelledError`
        after :meth:`cancel`.
        """
        if not self._driver.wait(self._work, timeout):
            raise TimeoutError(f"{self._where}: the round did not end within {timeout:g} s")
        try:
            return self._outcome()
        except asyncio.CancelledError:
            # Cancelled through cancel(), not by close(): the sync world's class.
            raise concurrent.futures.CancelledError(
                f"{self._where}: the round's wait was cancelled"
            ) from None

    def done(self) -> bool:
        """Whether :meth:`result` would return (or raise) without blocking."""
        return self._driver.poll(self._work)

    def cancel(self) -> bool:
        """Stop waiting for the round; False if it already ended.

        The contribution, once sent, still counts for the peers. The client
        stays usable: if the wait was cancelled while reading the shared
        stream, the next call opens a new one (calls queued on the old one
        re-send, which is idempotent).
        """
        if self._work.done():
            return False
        self._driver.cancel(self._work)
        self._driver.poll(self._work)
        return True
