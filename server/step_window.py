"""One group's rounds and the window of steps it still accepts.

A group keeps its live rounds and its newest finished ones (so a retry gets
the identical outcome). A step that fell out of that cache, or lies more than
``retained_steps`` behind the group's newest step, is refused as stale rather
than collected a second time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from .settings import CoordinatorSettings

if TYPE_CHECKING:
    from .rounds import Round

__all__ = ["StepWindow"]


class StepWindow:
    """The live and recently finished rounds of one ``(job, group)``, by step."""

    __slots__ = (
        "evicted",
        "finished",
        "judged_contracts",
        "last_activity",
        "live",
        "newest_step",
        "stale_floor",
    )

    def __init__(self, now: float) -> None:
        self.live: dict[int, Round] = {}
        self.finished: OrderedDict[int, Round] = OrderedDict()
        self.newest_step = -1
        # Steps evicted from the cache: a new round for one could double-count a
        # retry, so they are refused as stale. ``evicted`` holds them exactly, so a
        # step sent out of order that never opened is not refused with them; the
        # oldest fold into ``stale_floor`` (every step at or below it is refused)
        # once the set outgrows what pipelined steps can leave behind.
        self.evicted: set[int] = set()
        self.stale_floor = -1
        self.last_activity = now
        self.judged_contracts: tuple[str, ...] = ()
        """The last contract strings found within ``max_contract_length`` in this group:
        a contribution repeating them (every rank of every step, normally) is not
        measured again."""

    def retire(self, rnd: Round, settings: CoordinatorSettings) -> None:
        """Move the just finished ``rnd`` from live to the cache, evicting the oldest."""
        step = rnd.key.step
        del self.live[step]
        self.finished[step] = rnd
        while len(self.finished) > settings.finished_cache_size:
            oldest, _ = self.finished.popitem(last=False)
            self.evict(oldest, settings)

    def evict(self, step: int, settings: CoordinatorSettings) -> None:
        self.evicted.add(step)
        floor = max(self.stale_floor, self.newest_step - settings.retained_steps)
        bound = settings.finished_cache_size + 2 * settings.max_rounds_in_flight
        if len(self.evicted) > bound:
            self.evicted = {e for e in self.evicted if e > floor}
            while len(self.evicted) > bound:
                oldest = min(self.evicted)
                self.evicted.discard(oldest)
                floor = max(floor, oldest)
        while floor + 1 in self.evicted:
            floor += 1
            self.evicted.discard(floor)
        self.stale_floor = floor

    def is_stale(self, step: int, settings: CoordinatorSettings) -> int | None:
        """The floor ``step`` is refused under (for the message), or None if not stale."""
        floor = max(self.stale_floor, self.newest_step - settings.retained_steps)
        if step <= floor:
            return floor
        if step in self.evicted:
            return step
        return None
