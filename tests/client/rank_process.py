"""One rank of a multi-process test, run in a spawned process by test_processes.py.

Executed with ``runpy.run_path(path, init_globals={"RANK_ARGS": {...}})`` as
the target of a ``spawn`` process, so the child imports only the installed
package, not the test modules (which pytest's importlib mode cannot re-import). The rank reduces
every step and puts ``(rank, step, normalizers or error repr)`` on the queue.
"""

from __future__ import annotations

import multiprocessing.queues
from collections.abc import Sequence

from lossreduce.client import ClientSettings, LossReduceError, ReductionClient


def run_rank(
    *,
    target: str,
    job: str,
    rank: int,
    world_size: int,
    steps: Sequence[int],
    use_stream: bool,
    results: multiprocessing.queues.Queue[tuple[int, int, object]],
) -> None:
    settings = ClientSettings(use_stream=use_stream, retry_budget_s=10.0)
    with ReductionClient(
        target, job=job, group="g", rank=rank, world_size=world_size, settings=settings
    ) as client:
        for step in steps:
            # Partials chosen so the exact sum differs from naive float addition.
            partials = {"tokens": 1e16 if rank == 0 else 1.0, "seqs": float(rank % 2)}
            try:
                results.put((rank, step, client.reduce(step, partials)))
            except LossReduceError as err:
                results.put((rank, step, repr(err)))


if "RANK_ARGS" in globals():
    run_rank(**globals()["RANK_ARGS"])
