"""When to retry an unavailable coordinator, and how long to wait in between.

Retrying a contribution is safe because the coordinator treats an identical
re-sent contribution as the same contribution (same outcome, never counted
twice). This module is pure: time and randomness are passed in, so the
schedule is unit-testable without sleeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from lossreduce.client.settings import ClientSettings

__all__ = ["Backoff", "RetryBudget"]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with multiplicative jitter.

    Retry ``n`` (0-based) waits ``min(max_s, initial_s * multiplier**n)`` scaled
    by a factor drawn uniformly from ``[1 - jitter, 1 + jitter]``.
    """

    initial_s: float
    max_s: float
    multiplier: float
    jitter: float

    @classmethod
    def from_settings(cls, settings: ClientSettings) -> Backoff:
        return cls(
            initial_s=settings.initial_backoff_s,
            max_s=settings.max_backoff_s,
            multiplier=settings.backoff_multiplier,
            jitter=settings.jitter,
        )

    def base_delay(self, retry: int) -> float:
        """The delay before retry ``retry`` without jitter, in seconds."""
        # Cap the exponent's result before it overflows for very long outages.
        delay = self.initial_s
        for _ in range(retry):
            delay *= self.multiplier
            if delay >= self.max_s:
                return self.max_s
        return min(delay, self.max_s)

    def delay(self, retry: int, rng: random.Random) -> float:
        """The delay before retry ``retry`` with jitter, in seconds."""
        spread = rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return self.base_delay(retry) * (1.0 + spread)


@dataclass
class RetryBudget:
    """Tracks one call's attempts against the settings' total retry budget.

    The budget counts from the first failed attempt, not from the start of the
    call: a call may legitimately wait minutes for slow peers before the
    coordinator goes away, and that wait must not eat the time left to retry.
    """

    backoff: Backoff
    budget_s: float
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0
    """Attempts made so far (the first send counts as one)."""
    first_failure_at: float | None = None
    """Clock time of the first failed attempt, None while nothing failed."""

    def record_attempt(self) -> None:
        self.attempts += 1

    def failed(self, now: float) -> float | None:
        """Record that the latest attempt failed at ``now``; return the delay
        before the next attempt, or None when the budget allows no more."""
        if self.first_failure_at is None:
            self.first_failure_at = now
        delay = self.backoff.delay(max(self.attempts - 1, 0), self.rng)
        if self.elapsed(now) + delay > self.budget_s:
            return None
        return delay

    def elapsed(self, now: float) -> float:
        """Seconds since the first failed attempt (0 while nothing failed)."""
        return 0.0 if self.first_failure_at is None else now - self.first_failure_at
