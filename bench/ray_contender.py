"""Contender 5 of ``lossreduce bench``: a Ray async actor used as the coordinator.

The straightforward way to coordinate ranks on Ray: one named async actor;
each rank calls ``reduce.remote(step, rank, world_size, partials)``, the call
waits until every rank of the step has arrived and returns the exact sums.
Ray workers import this module by name, so it must stay importable alone.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Sequence

from lossreduce.bench.contenders import CALL_TIMEOUT_S, Endpoints
from lossreduce.bench.workload import partials_for

__all__ = ["RAY_NAMESPACE", "RayActorCoordinator", "RayRanks", "start_ray_coordinator"]

RAY_NAMESPACE = "lossreduce-bench"


class RayActorCoordinator:
    """The round table of the Ray contender (instantiated as a Ray async actor)."""

    def __init__(self) -> None:
        self._partials: dict[int, dict[int, Sequence[float]]] = {}
        self._done: dict[int, asyncio.Event] = {}
        self._sums: dict[int, list[float]] = {}

    def pid(self) -> int:
        return os.getpid()

    async def reduce(
        self, step: int, rank: int, world_size: int, partials: Sequence[float]
    ) -> list[float]:
        arrived = self._partials.setdefault(step, {})
        done = self._done.setdefault(step, asyncio.Event())
        arrived[rank] = partials
        if len(arrived) == world_size:
            # Rank order + fsum: the same exactness guarantee as the coordinator.
            rows = [arrived[r] for r in range(world_size)]
            self._sums[step] = [math.fsum(column) for column in zip(*rows, strict=True)]
            self._partials.pop(step - 2, None)
            self._done.pop(step - 2, None)
            self._sums.pop(step - 2, None)
            done.set()
        await done.wait()
        return self._sums[step]


def start_ray_coordinator(name: str) -> tuple[object, int]:
    """Create the named actor in the connected Ray cluster; return it and its pid."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(RayActorCoordinator)
    actor = actor_cls.options(name=name, namespace=RAY_NAMESPACE).remote()
    pid: int = ray.get(actor.pid.remote(), timeout=CALL_TIMEOUT_S)
    return actor, pid


class RayRanks:
    """The ranks of one load process calling the Ray-actor coordinator."""

    exact = True
    checked = True

    def __init__(self, endpoints: Endpoints, ranks: Sequence[int], world_size: int) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=endpoints.ray_address,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
                logging_level="ERROR",
            )
        self._actor = ray.get_actor(endpoints.ray_actor, namespace=RAY_NAMESPACE)
        self._ranks = tuple(ranks)
        self._world_size = world_size

    async def run_round(self, step: int) -> list[Sequence[float]]:
        calls = [
            self._actor.reduce.remote(step, rank, self._world_size, partials_for(rank, step))
            for rank in self._ranks
        ]
        sums: list[Sequence[float]] = await asyncio.wait_for(asyncio.gather(*calls), CALL_TIMEOUT_S)
        return sums

    async def close(self) -> None:
        import ray

        ray.shutdown()
