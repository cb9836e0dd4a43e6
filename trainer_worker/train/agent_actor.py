"""One node agent per node that holds workers, each a Ray actor pinned to its node.

With node aggregation on (``--aggregation node``, or ``auto`` when the workers
span more than one node) every rank sends its contribution to the agent on its
own node over loopback, and the agent sends the coordinator one aggregated
contribution per round for all of them (:mod:`lossreduce.client.agent`). The
coordinator still names a missing or malformed rank itself, so errors read the
same as without agents, and the normalizers are bit-identical.

An agent holds the run's upstream credentials (the bearer token and, over TLS,
the run's CA), handed to it through Ray as constructor arguments. It listens on
loopback only, so nothing leaves its node but the one upstream stream.

An agent is not restarted (``max_restarts=0``): it binds a fresh port, which
its ranks could not find again. When one dies its ranks' calls fail (after
their retry budget), their peers get the coordinator's missing-ranks error
within the round timeout, and the driver's failure report names the dead
agent, its node and its ranks (:meth:`NodeAgents.dead`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lossreduce.trainer_worker.train.placement import BundleSlot, describe_slot
from lossreduce.trainer_worker.train.worker_group import death_reason

if TYPE_CHECKING:
    from lossreduce.client.agent import AgentSettings

__all__ = ["AgentActor", "NodeAgents", "agent_name", "node_ranks", "start_node_agents"]

PING_TIMEOUT_S = 5.0
"""How long :meth:`NodeAgents.dead` waits for an agent to answer before calling it dead."""


def agent_name(job: str, node_id: str) -> str:
    """The Ray actor name of the agent of ``job`` on a node (``ray.get_actor`` finds it)."""
    return f"lossreduce-agent-{job}-{node_id[:12]}"


def node_ranks(slots: Sequence[BundleSlot]) -> dict[str, tuple[int, ...]]:
    """Ranks per node id, in rank order (slots are already ordered by node)."""
    ranks: dict[str, list[int]] = {}
    for rank, slot in enumerate(slots):
        ranks.setdefault(slot.node_id, []).append(rank)
    return {node: tuple(r) for node, r in ranks.items()}


class AgentActor:
    """Runs a :class:`NodeAgentThread` inside a Ray actor on its node."""

    def __init__(
        self, upstream: str, job: str, group: str, world_size: int, settings: AgentSettings
    ) -> None:
        from lossreduce.client.agent import NodeAgentThread

        self._thread = NodeAgentThread(
            upstream, job=job, group=group, world_size=world_size, settings=settings
        ).start()
        try:
            # Unreachable upstream or refused credentials: fail here, naming the coordinator,
            # rather than at the first round.
            self._thread.check_upstream()
        except BaseException:
            self._thread.stop()
            raise

    def target(self) -> str:
        """``HOST:PORT`` this node's ranks dial (loopback)."""
        target: str = self._thread.target
        return target

    def stop(self) -> None:
        self._thread.stop()


@dataclass(frozen=True)
class NodeAgents:
    """The started agents of a run, by node id."""

    actors: dict[str, Any]
    targets: dict[str, str]
    ranks: dict[str, tuple[int, ...]]
    slots: tuple[BundleSlot, ...]

    def target_of(self, rank: int) -> str:
        """The agent ``rank`` dials: the one on its own node."""
        return self.targets[self.slots[rank].node_id]

    def dead(self) -> list[str]:
        """One phrase per agent that no longer answers, naming its node and ranks."""
        refs = {node: actor.target.remote() for node, actor in self.actors.items()}
        found = []
        for node, ref in refs.items():
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                slot = self.slots[self.ranks[node][0]]
                found.append(
                    f"the agent on {describe_slot(slot)} serving ranks "
                    f"{list(self.ranks[node])} is gone"
                )
        return found

    def stop(self) -> None:
        """Stop every agent (a dead or hung one is just killed); never raises."""
        refs = [actor.stop.remote() for actor in self.actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=10)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)


def start_node_agents(
    slots: Sequence[BundleSlot],
    upstream: str,
    *,
    job: str,
    group: str,
    settings: AgentSettings,
    timeout_s: float,
) -> NodeAgents:
    """One agent per node of ``slots``, pinned there, serving that node's ranks.

    Raises ``RuntimeError`` naming the node when an agent does not start within
    ``timeout_s`` (the agents started so far are stopped).
    """
    ranks = node_ranks(slots)
    actor_cls = ray.remote(AgentActor)
    actors = {
        node: actor_cls.options(
            name=agent_name(job, node),
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(
            upstream,
            job,
            group,
            len(slots),
            settings.model_copy(update={"local_ranks": node_ranks_of}),
        )
        for node, node_ranks_of in ranks.items()
    }
    agents = NodeAgents(actors=actors, targets={}, ranks=ranks, slots=tuple(slots))
    try:
        for node, actor in actors.items():
            try:
                agents.targets[node] = ray.get(actor.target.remote(), timeout=timeout_s)
            except (RayActorError, GetTimeoutError) as err:
                slot = slots[ranks[node][0]]
                raise RuntimeError(
                    f"the node agent on {describe_slot(slot)} for ranks {list(ranks[node])} "
                    f"did not start: {death_reason(err)}"
                ) from err
    except BaseException:
        agents.stop()
        raise
    return agents
