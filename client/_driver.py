"""One event loop, driven by whichever caller thread is waiting on it.

The blocking client serves its caller on the caller's own thread: the thread
that needs an answer runs the client's loop (``run_until_complete``) until the
answer is there. That spares a round two thread hand-offs (onto a private
loop thread and back), which cost more CPU than the round's own gRPC work.

Several threads may share one client, but a loop runs on one thread at a
time. The first thread to need the loop drives it; others hand their work to
the running loop (``run_coroutine_threadsafe``) and sleep on a condition
until either their own work is done or the driver stops, whereupon one of
them takes over. No thread ever waits on work it could be running itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import TypeVar

__all__ = ["LoopDriver", "Waitable"]

_T = TypeVar("_T")

Waitable = asyncio.Future[_T] | concurrent.futures.Future[_T]
"""A task spawned on the loop: an asyncio task, or a concurrent future when
another thread drove the loop at the time."""

_POLL_ITERATIONS = 8
"""Loop iterations :meth:`LoopDriver.poll` runs at most: an answer passes
through the gRPC poller, the stream's reader and the caller's task."""


class LoopDriver:
    """An event loop with no thread of its own (see the module docstring)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._cond = threading.Condition()
        self._driving = False
        self._closed = False

    def spawn(self, coro: Coroutine[object, object, _T]) -> Waitable[_T]:
        """Start ``coro`` as a task on the loop; it runs while someone drives."""
        with self._cond:
            if self._closed:
                coro.close()
                raise RuntimeError("the client's event loop is closed")
            if not self._driving:
                # No thread runs the loop, so this one may touch it directly.
                return self.loop.create_task(coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, work: Waitable[_T], timeout: float | None) -> bool:
        """Block until ``work`` is done, driving the loop while no other thread
        does; False if ``timeout`` (seconds) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        watched = False
        while not work.done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            with self._cond:
                if self._driving or self._closed:
                    if not watched:
                        self._watch(work)
                        watched = True
                    self._cond.wait(remaining)
                    continue
                if _thread_runs_a_loop():
                    # This thread's own loop is running, so it cannot run ours.
                    self._drive_elsewhere(work, remaining)
                    continue
                self._driving = True
            try:
                self._drive(work, remaining)
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()
        return True

    def poll(self, work: Waitable[_T]) -> bool:
        """Whether ``work`` is done, after letting the loop catch up (without
        blocking) when no other thread drives it."""
        if work.done() or _thread_runs_a_loop():
            return work.done()
        with self._cond:
            if self._driving or self._closed:
                return work.done()
            self._driving = True
        try:
            for _ in range(_POLL_ITERATIONS):
                if work.done():
                    break
                # One iteration of the loop: ready callbacks and I/O already in.
                self.loop.call_soon(self.loop.stop)
                self.loop.run_forever()
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()
        return work.done()

    def cancel(self, work: Waitable[_T]) -> None:
        """Cancel ``work``; the task sees it the next time the loop runs."""
        if isinstance(work, concurrent.futures.Future):
            work.cancel()
            return
        with self._cond:
            if not self._closed:
                self.loop.call_soon_threadsafe(work.cancel)

    def close(self) -> None:
        """Close the loop once no thread drives it; later spawns raise."""
        with self._cond:
            while self._driving:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
        self.loop.close()

    def _watch(self, work: Waitable[_T]) -> None:
        """Wake the waiters when ``work`` ends (called with the condition held)."""
        if isinstance(work, concurrent.futures.Future):
            work.add_done_callback(self._wake)
        elif not self._closed:
            # An asyncio future is only touched on the loop's own thread.
            self.loop.call_soon_threadsafe(work.add_done_callback, self._wake)

    def _wake(self, _: object) -> None:
        with self._cond:
            self._cond.notify_all()

    def _drive(self, work: Waitable[_T], timeout: float | None) -> None:
        # Run on this thread, with the driving flag held by it.
        target: asyncio.Future[_T] = (
            asyncio.wrap_future(work, loop=self.loop)
            if isinstance(work, concurrent.futures.Future)
            else work
        )
        try:
            if timeout is None:
                self.loop.run_until_complete(target)
            else:
                # wait() rather than wait_for(): a timeout must not cancel the work.
                self.loop.run_until_complete(asyncio.wait((target,), timeout=timeout))
        except BaseException:
            if not work.done():
                raise
            # The work's own outcome is the caller's to read from ``work``.

    def _drive_elsewhere(self, work: Waitable[_T], timeout: float | None) -> None:
        """Drive the loop from a helper thread (called with the condition held,
        which the helper needs, so it is released while waiting)."""
        helper = threading.Thread(target=self.wait, args=(work, timeout), daemon=True)
        helper.start()
        self._cond.release()
        try:
            helper.join()
        finally:
            self._cond.acquire()


def _thread_runs_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
