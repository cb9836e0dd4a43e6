"""What Python 3.11 added that lossreduce uses, for Python 3.10.

The package supports Python 3.10-3.13. Each name here is the standard library's
own on 3.11 and later, and an equivalent on 3.10; nothing else differs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from datetime import timezone
from typing import TypeVar

__all__ = ["UTC", "StrEnum", "cancelling", "within"]

T = TypeVar("T")

UTC = timezone.utc
"""``datetime.UTC`` (an alias of ``timezone.utc`` since 3.11)."""

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised by the Python 3.10 cell of the test matrix
    from enum import Enum

    class StrEnum(str, Enum):
        """``enum.StrEnum``: members are strings, and ``str()``/``format()`` give the value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, format_spec: str) -> str:
            return format(str(self.value), format_spec)


if sys.version_info >= (3, 11):

    async def within(timeout: float, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``timeout`` seconds.

        A timer on the calling task (``asyncio.timeout``): no task per call, which
        matters on a rank's per-round path. 3.10 has only ``wait_for``.
        """
        async with asyncio.timeout(timeout):
            return await awaitable

    def cancelling(task: asyncio.Task[object] | None) -> bool:
        """Whether someone asked to cancel ``task`` (``Task.cancelling()``).

        Python 3.10 cannot tell a cancellation of the task from one that gRPC raises
        into it when a call ends; there this answers False, so such a cancellation
        reads as the call's end (the client closed, the stream broke) and the caller
        gets that error instead of ``CancelledError``.
        """
        return task is not None and task.cancelling() > 0

else:  # pragma: no cover - Python 3.10

    async def within(timeout: float, awaitable: Awaitable[T]) -> T:
        return await asyncio.wait_for(awaitable, timeout)

    def cancelling(task: asyncio.Task[object] | None) -> bool:
        return False
