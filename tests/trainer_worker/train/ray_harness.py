"""A small local Ray cluster for one test module (2 CPUs, no dashboard)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray

__all__ = ["local_ray"]


@contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """Start a fresh local Ray session (ending any left over) and shut it down after."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING", log_to_driver=False
    )
    try:
        yield
    finally:
        ray.shutdown()
