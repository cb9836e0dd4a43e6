"""The pure half of node aggregation: what a node sends upstream for a round.

:func:`node_requests` decides, from a round's local contributions alone,
whether the node sends one aggregated request (exact per-term sums as
expansions) or every rank's own request (a contribution is invalid, disagrees
with its peers, or names another run). :class:`AggregatorSettings` and
:class:`AggregatorObserver` are what the asyncio shell,
:class:`~lossreduce.client.aggregator.NodeAggregator`, is configured and
observed with. No gRPC calls and no event loop here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, Protocol

from pydantic import Field

from lossreduce.client.expansion import ExpansionOverflowError, exact_expansion
from lossreduce.client.settings import ClientSettings
from lossreduce.contribution import Contribution, contribution_digest
from lossreduce.contribution_check import check_contribution
from lossreduce.v2 import coordinator_pb2 as pb

__all__ = [
    "FALLBACK_INVALID",
    "FALLBACK_NODE_TIMEOUT",
    "FALLBACK_REGROUPED",
    "FALLBACK_UNKNOWN_RANKS",
    "AggregatorObserver",
    "AggregatorSettings",
    "node_requests",
]

FALLBACK_INVALID: Final = "invalid"
"""A local contribution was invalid or disagreed with its peers: each went up alone."""
FALLBACK_NODE_TIMEOUT: Final = "node_timeout"
"""Local ranks were missing at the node's deadline: the rest went up as they came."""
FALLBACK_REGROUPED: Final = "regrouped"
"""An aggregate mixed ranks the coordinator had counted (grouped otherwise, by a
restarted agent or before the node's deadline) with ranks it had not: each went
up again alone."""
FALLBACK_UNKNOWN_RANKS: Final = "unknown_ranks"
"""The node did not know its local ranks yet (learned from its first successful round)."""


class AggregatorSettings(ClientSettings):
    """How a node aggregator talks to the coordinator (as a client does) and how long
    it waits for its own ranks."""

    node_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Seconds the node waits for all its local ranks of a round before it hands the "
            "coordinator the ranks that arrived (and each later one as it arrives); the "
            "coordinator's round timeout then decides the round for every node alike. Keep it "
            "below the coordinator's round timeout, so that timeout names only the ranks "
            "that never came."
        ),
    )


class AggregatorObserver(Protocol):
    """What a node aggregator reports as it works (the agent's metrics implement it)."""

    def round_forwarded(self, job: str, group: str) -> None:
        """A round's first contribution went upstream."""

    def fell_back(self, job: str, group: str, reason: str) -> None:
        """A round's local ranks go upstream one by one; ``reason`` is a ``FALLBACK_*``."""

    def upstream_reconnected(self, job: str, group: str) -> None:
        """The upstream stream broke and a new one was opened."""

    def upstream_failed(self, job: str, group: str, code: str) -> None:
        """Local ranks got the node's own failure to reach the coordinator (status ``code``)."""

    def round_answered(self, job: str, group: str, seconds: float) -> None:
        """Every arrived local rank of a round has its answer, ``seconds`` after the first came."""


def node_requests(
    key: pb.RoundKey, contributions: Sequence[Contribution]
) -> list[pb.ReduceRequest]:
    """What a node sends upstream for one round: one aggregated request covering
    every local rank, or, when any contribution is invalid or disagrees with
    the first, every rank's own request (so the coordinator names the culprit)."""
    ordered = sorted(contributions, key=lambda c: c.rank)
    first = ordered[0]
    agree = all(
        c.world_size == first.world_size
        and c.terms == first.terms
        and c.contracts == first.contracts
        # One request names one run; ranks of different runs go up alone and the
        # coordinator tells each which run holds the group.
        and c.run == first.run
        for c in ordered
    )
    distinct = len({c.rank for c in ordered}) == len(ordered)
    # Every contribution names the first one's terms: judge those names once.
    valid = (
        agree
        and distinct
        and check_contribution(first) is None
        and all(check_contribution(c, known_terms=first.terms) is None for c in ordered[1:])
    )
    if not valid:
        return [c.request(key) for c in ordered]
    expansions = []
    for index in range(len(first.terms)):
        column = [c.values[index] for c in ordered]  # [local ranks], in rank order
        try:
            expansions.append(exact_expansion(column))
        except ExpansionOverflowError:
            # The coordinator reports an overflowing normalizer for the whole round.
            return [c.request(key) for c in ordered]
    aggregated = Contribution(
        rank=first.rank,
        world_size=first.world_size,
        terms=first.terms,
        # The rounded sums; the expansions are what the coordinator sums.
        values=tuple(math.fsum(e) for e in expansions),
        contracts=first.contracts,
        covers=tuple(c.rank for c in ordered),
        expansions=tuple(expansions),
        zero_ranks=tuple(
            [sum(1 for c in ordered if c.values[i] == 0.0) for i in range(len(first.terms))]
        ),
        run=first.run,
        # Per rank, so a retry of these ranks grouped otherwise (a restarted agent,
        # a passed deadline) is still recognised rank by rank.
        rank_digests=tuple(contribution_digest(c) for c in ordered),
    )
    return [aggregated.request(key)]
