"""The backoff schedule and the retry budget (pure, no sleeping)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from lossreduce.client import ClientSettings
from lossreduce.client.retry import Backoff, RetryBudget


def test_base_delays_grow_geometrically_then_cap() -> None:
    backoff = Backoff(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.0)
    assert [backoff.base_delay(n) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_huge_retry_index_does_not_overflow() -> None:
    backoff = Backoff(initial_s=0.1, max_s=3.0, multiplier=10.0, jitter=0.0)
    assert backoff.base_delay(10_000) == 3.0


def test_from_settings_copies_every_backoff_field() -> None:
    settings = ClientSettings(
        initial_backoff_s=0.3, max_backoff_s=4.0, backoff_multiplier=1.5, jitter=0.1
    )
    assert Backoff.from_settings(settings) == Backoff(0.3, 4.0, 1.5, 0.1)


backoffs = st.builds(
    Backoff,
    initial_s=st.floats(1e-3, 1.0),
    max_s=st.floats(1.0, 10.0),
    multiplier=st.floats(1.0, 4.0),
    jitter=st.floats(0.0, 0.99),
)


@given(backoff=backoffs, retry=st.integers(0, 200), seed=st.integers(0, 2**32))
def test_jittered_delay_stays_within_the_spread(backoff: Backoff, retry: int, seed: int) -> None:
    initial, cap, jitter = backoff.initial_s, backoff.max_s, backoff.jitter
    base = backoff.base_delay(retry)
    assert initial <= base <= cap
    assert base <= backoff.base_delay(retry + 1)
    delay = backoff.delay(retry, random.Random(seed))
    assert base * (1 - jitter) <= delay <= base * (1 + jitter)


@given(
    budget_s=st.floats(0.0, 30.0),
    jitter=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**32),
)
def test_budget_never_schedules_past_its_end(budget_s: float, jitter: float, seed: int) -> None:
    budget = RetryBudget(Backoff(0.05, 2.0, 2.0, jitter), budget_s, random.Random(seed))
    now = 100.0  # the clock is the caller's; a failure takes no time here
    while True:
        budget.record_attempt()
        delay = budget.failed(now)
        if delay is None:
            break
        assert delay > 0
        now += delay
        assert budget.elapsed(now) <= budget_s
    assert budget.attempts >= 1


def test_zero_budget_means_one_attempt() -> None:
    budget = RetryBudget(Backoff(0.05, 2.0, 2.0, 0.0), 0.0)
    budget.record_attempt()
    assert budget.failed(5.0) is None
    assert budget.attempts == 1


def test_budget_counts_from_the_first_failure_not_the_call_start() -> None:
    budget = RetryBudget(Backoff(1.0, 1.0, 1.0, 0.0), budget_s=2.5)
    budget.record_attempt()
    # The first attempt waited 1000 s for slow peers before the coordinator left.
    assert budget.failed(1000.0) == 1.0
    budget.record_attempt()
    assert budget.failed(1001.0) == 1.0
    budget.record_attempt()
    assert budget.failed(1002.0) is None  # 2 s elapsed + 1 s delay > 2.5 s
    assert budget.elapsed(1002.0) == 2.0
    assert budget.attempts == 3
