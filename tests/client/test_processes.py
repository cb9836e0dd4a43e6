"""Ranks in separate processes (multiprocessing ``spawn``), as trainer workers run."""

from __future__ import annotations

import math
import multiprocessing
import runpy
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("rank_process.py")


@pytest.mark.timeout(120)
def test_ranks_in_spawned_processes_get_identical_exact_normalizers(coordinator) -> None:
    world, steps = 4, [1, 2, 3]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=runpy.run_path,
            args=(str(WORKER),),
            kwargs={
                "init_globals": {
                    "RANK_ARGS": {
                        "target": coordinator.target,
                        "job": "procs",
                        "rank": rank,
                        "world_size": world,
                        "steps": steps,
                        # Ranks 0 and 2 stream, 1 and 3 use unary calls.
                        "use_stream": rank % 2 == 0,
                        "results": results,
                    }
                },
            },
            name=f"rank-{rank}",
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    got = {}
    for _ in range(world * len(steps)):
        rank, step, answer = results.get(timeout=90)
        got[(rank, step)] = answer
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0, process.name
    expected = {"tokens": math.fsum([1e16, 1.0, 1.0, 1.0]), "seqs": 2.0}
    assert expected["tokens"] != 1e16 + 1.0 + 1.0 + 1.0
    assert got == {(rank, step): expected for rank in range(world) for step in steps}
