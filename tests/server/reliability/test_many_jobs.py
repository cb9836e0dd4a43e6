"""A long-lived coordinator serving many short jobs keeps flat metrics and memory.

Every ``lossreduce train`` run is a new job name, so a coordinator that kept
each job's series (about 60 per job) or state would grow without bound. Jobs
here are driven through a real :class:`CoordinatorThread` whose groups are
forgotten soon after they go idle; after every batch of jobs the test waits
(bounded) until their series are gone, then checks that ``/metrics`` is back
to its size after the warm-up and that traced Python memory has not grown
with the number of jobs.
"""

from __future__ import annotations

import gc
import math
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator

import pytest
from google.rpc import code_pb2

from lossreduce.server import CoordinatorThread
from tests.conftest import CoordinatorFactory
from tests.raw_stub import Ranks, Send

BATCHES = 4
JOBS_PER_BATCH = 50
DRAIN_BOUND_S = 30.0
"""How long a batch's groups may take to be forgotten; only a leak reaches it."""
METRICS_SLACK_BYTES = 256
"""Room for counters without a job label (``rpc_errors``) gaining digits."""
MEMORY_SLACK_BYTES = 128 * 1024
"""Traced growth tolerated over all batches (measured: under 40 KiB of caches and
allocator noise); 200 jobs keeping even 1 KiB each would exceed it."""


@pytest.fixture
def coordinator(coordinator_factory: CoordinatorFactory) -> CoordinatorThread:
    # Sweeps run every round_timeout_s; a group idle for idle_group_ttl_s is forgotten
    # (long enough that the scrape right after a job still sees its series).
    return coordinator_factory(round_timeout_s=0.1, idle_group_ttl_s=0.5)


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def run_job(ranks: Ranks, job: str) -> None:
    """One short job: a completed round of two ranks with two terms (one of them
    with a zero partial), then a round its only rank aborts with a NaN partial."""
    sends = [
        Send(rank=r, world_size=2, partials={"tokens": 1.0 + r, "kl": float(r)}, job=job)
        for r in range(2)
    ]
    sends.append(Send(rank=0, world_size=1, partials={"tokens": math.nan}, step=2, job=job))
    answers = ranks.stream(sends)
    assert [a.code for a in answers] == [code_pb2.OK, code_pb2.OK, code_pb2.INVALID_ARGUMENT]
    assert answers[0].normalizers == {"tokens": (3.0, 0), "kl": (1.0, 1)}


def scrape(coordinator: CoordinatorThread) -> str:
    assert coordinator.metrics_url is not None
    with urllib.request.urlopen(coordinator.metrics_url, timeout=5) as reply:
        text: str = reply.read().decode()
    return text


def job_series(text: str) -> list[str]:
    return [line for line in text.splitlines() if 'job="' in line and not line.startswith("#")]


def drained(coordinator: CoordinatorThread) -> str:
    """``/metrics`` once no job's series is left in it (bounded by ``DRAIN_BOUND_S``)."""
    deadline = time.monotonic() + DRAIN_BOUND_S
    text = scrape(coordinator)
    while job_series(text) and time.monotonic() < deadline:
        time.sleep(0.05)
        text = scrape(coordinator)
    assert not job_series(text), f"series of forgotten jobs remain: {job_series(text)[:5]}"
    return text


def traced_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_many_short_jobs_keep_metrics_and_memory_flat(
    coordinator: CoordinatorThread, ranks: Ranks, traced: None
) -> None:
    for j in range(JOBS_PER_BATCH):  # warm-up: every code path and cache once
        run_job(ranks, f"warmup-{j}")
    while_live = job_series(scrape(coordinator))
    baseline_text = drained(coordinator)
    baseline_memory = traced_bytes()

    sizes, memory = [], []
    for batch in range(BATCHES):
        for j in range(JOBS_PER_BATCH):
            run_job(ranks, f"train-{batch}-{j}")
        sizes.append(len(drained(coordinator)))
        memory.append(traced_bytes())

    # The jobs did have series while they were live (the check above is not vacuous).
    assert while_live
    assert all(size <= len(baseline_text) + METRICS_SLACK_BYTES for size in sizes), (
        len(baseline_text),
        sizes,
    )
    growth = [m - baseline_memory for m in memory]
    assert max(growth) < MEMORY_SLACK_BYTES, growth
