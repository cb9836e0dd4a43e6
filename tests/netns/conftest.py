"""Fixtures of the network-fault tests: a private network of namespaces per test.

- ``network``: a fresh :class:`~tests.netns.harness.Network` (switch and bridge),
  closed when the test ends, pass or fail: every process it started is
  SIGKILLed and every namespace deleted. Stale namespaces of crashed earlier
  runs are removed first. Skips, naming the reason, only where namespaces
  cannot be created (not root, no iproute2); CI runs as root, so there it runs.
- ``cluster_factory(**kwargs)``: :func:`tests.netns.cluster.start_cluster` on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netns.cluster import Cluster, start_cluster
from tests.netns.harness import Network, remove_stale, unavailable_reason

_reason: list[str | None] = []


@pytest.fixture
def network(tmp_path: Path) -> Iterator[Network]:
    if not _reason:
        _reason.append(unavailable_reason())
        remove_stale()
    if _reason[0] is not None:
        pytest.skip(f"network namespaces unavailable: {_reason[0]}")
    net = Network(tmp_path)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def cluster_factory(network: Network, tmp_path: Path) -> Callable[..., Cluster]:
    def make(**kwargs: Any) -> Cluster:
        return start_cluster(network, tmp_path, **kwargs)

    return make
