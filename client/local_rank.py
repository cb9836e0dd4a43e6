"""One local rank's view of a node aggregator: the client's ``reduce`` over the node.

Made by :meth:`lossreduce.client.aggregator.NodeAggregator.local_rank`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from lossreduce.contribution import Contribution
from lossreduce.errors import LossReduceError

if TYPE_CHECKING:
    from lossreduce.client.aggregator import NodeAggregator

__all__ = ["LocalRank"]


class LocalRank:
    """One local rank of a :class:`NodeAggregator`: the rank side of
    :class:`~lossreduce.client.AsyncReductionClient` (the same ``reduce``), over
    the node's stream. Made by :meth:`NodeAggregator.local_rank`."""

    def __init__(self, node: NodeAggregator, rank: int) -> None:
        self.node = node
        self.job = node.job
        self.group = node.group
        self.rank = rank
        self.world_size = node.world_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.node!r}, rank={self.rank})"

    async def reduce(
        self,
        step: int,
        partials: Mapping[str, float],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """This rank's partials for ``step`` in, the global normalizers out (identical on
        every rank); raises the round's :mod:`lossreduce.errors` error otherwise."""
        terms = tuple(partials)
        contracts = contracts or {}
        mine = Contribution(
            rank=self.rank,
            world_size=self.world_size,
            terms=terms,
            values=tuple(map(float, partials.values())),
            contracts=tuple([contracts.get(t, "") for t in terms]),
            run=self.node.run,
        )
        (result,) = await self.node.reduce_node(step, [mine])
        if isinstance(result, LossReduceError):
            raise result
        return result
