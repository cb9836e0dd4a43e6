"""Placement: one bundle per rank, ranks ordered by node then bundle."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lossreduce.trainer_worker.train.placement import (
    BundleSlot,
    create_worker_placement,
    describe_slot,
    order_slots,
)
from tests.ray_support import local_ray


def test_ranks_are_ordered_by_node_ip_then_node_id_then_bundle() -> None:
    bundle_nodes = {0: "node-b", 1: "node-a", 2: "node-b", 3: "node-c", 4: "node-a"}
    node_ips = {"node-a": "10.0.0.2", "node-b": "10.0.0.1", "node-c": "10.0.0.1"}
    slots = order_slots(bundle_nodes, node_ips)
    assert [(s.node_ip, s.node_id, s.bundle_index) for s in slots] == [
        ("10.0.0.1", "node-b", 0),
        ("10.0.0.1", "node-b", 2),
        ("10.0.0.1", "node-c", 3),
        ("10.0.0.2", "node-a", 1),
        ("10.0.0.2", "node-a", 4),
    ]
    # The order depends only on where bundles are, not on the mapping's order.
    shuffled = dict(reversed(list(bundle_nodes.items())))
    assert order_slots(shuffled, node_ips) == slots


def test_describe_slot_names_ip_and_node_id() -> None:
    slot = BundleSlot(bundle_index=3, node_id="abcdef0123456789", node_ip="10.1.2.3")
    assert describe_slot(slot) == "node 10.1.2.3 (id abcdef012345)"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


@pytest.mark.ray
def test_real_placement_is_deterministic_and_one_cpu_bundle_per_rank(ray_session: None) -> None:
    orders = []
    for _ in range(2):
        placement = create_worker_placement(2, "PACK", timeout_s=60)
        try:
            assert not placement.use_gpu
            assert placement.actor_resources() == {"num_cpus": 1.0, "num_gpus": 0.0}
            assert placement.group.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
            orders.append(placement.slots)
        finally:
            placement.remove()
    assert orders[0] == orders[1]
    assert [s.bundle_index for s in orders[0]] == [0, 1]  # one node: bundle order
    assert len({s.node_id for s in orders[0]}) == 1


@pytest.mark.ray
def test_unplaceable_request_names_strategy_and_resources(ray_session: None) -> None:
    # One node cannot hold two bundles on distinct nodes.
    with pytest.raises(
        TimeoutError, match=r"2 bundles \{'CPU': 1\.0\} with strategy STRICT_SPREAD"
    ):
        create_worker_placement(2, "STRICT_SPREAD", timeout_s=1.0)
