"""Placing the trainer workers: one placement-group bundle per rank.

Each rank gets a bundle of one GPU when the cluster has GPUs, else one CPU.
Ranks are then ordered deterministically — by node (IP, then node id), then by
bundle index — so a rerun on the same cluster maps the same shards to the same
places, and ranks on one node are neighbours (good for nccl rings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

__all__ = [
    "BundleSlot",
    "WorkerPlacement",
    "create_worker_placement",
    "describe_slot",
    "order_slots",
]


@dataclass(frozen=True)
class BundleSlot:
    """Where one rank runs: its bundle of the placement group and that bundle's node."""

    bundle_index: int
    node_id: str
    node_ip: str


def order_slots(bundle_nodes: Mapping[int, str], node_ips: Mapping[str, str]) -> list[BundleSlot]:
    """Bundles sorted by node (IP, then id) and bundle index; position = rank."""
    slots = [
        BundleSlot(bundle_index=index, node_id=node, node_ip=node_ips.get(node, ""))
        for index, node in bundle_nodes.items()
    ]
    return sorted(slots, key=lambda s: (s.node_ip, s.node_id, s.bundle_index))


@dataclass(frozen=True)
class WorkerPlacement:
    """A ready placement group and its slots in rank order."""

    group: PlacementGroup
    slots: tuple[BundleSlot, ...]
    use_gpu: bool

    def actor_resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` a worker actor asks for inside its bundle."""
        return (
            {"num_cpus": 0.0, "num_gpus": 1.0}
            if self.use_gpu
            else {"num_cpus": 1.0, "num_gpus": 0.0}
        )

    def remove(self) -> None:
        remove_placement_group(self.group)


def create_worker_placement(workers: int, strategy: str, timeout_s: float) -> WorkerPlacement:
    """Reserve ``workers`` bundles and wait until they are placed.

    Raises ``TimeoutError`` naming the request and the cluster's resources when
    the cluster cannot hold it within ``timeout_s``.
    """
    use_gpu = ray.cluster_resources().get("GPU", 0.0) >= 1.0
    bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(workers)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"placement group of {workers} bundles {bundle} with strategy {strategy} was not "
            f"placed within {timeout_s:g}s; cluster resources: {ray.cluster_resources()}"
        )
    table: dict[str, Any] = placement_group_table(group)
    bundle_nodes = {int(i): str(node) for i, node in table["bundles_to_node_id"].items()}
    node_ips = {str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in ray.nodes()}
    return WorkerPlacement(
        group=group, slots=tuple(order_slots(bundle_nodes, node_ips)), use_gpu=use_gpu
    )


def describe_slot(slot: BundleSlot) -> str:
    """``node 10.0.0.3 (id 1a2b3c4d...)``: a slot's node for messages."""
    return f"node {slot.node_ip or '?'} (id {slot.node_id[:12]})"
