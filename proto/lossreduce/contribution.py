"""One contribution to one round, as both sides of the wire see it.

A *contribution* is what one ``ReduceRequest`` carries: a rank's partial per
term (or, from a node aggregator, the exact sums of several ranks). The
client's node aggregator builds them, the coordinator's round table judges
them; both use this one model and its two conversions to and from the wire
(:meth:`Contribution.from_request`, :meth:`Contribution.request`), so a
request means the same thing on both sides. Nothing here validates: the
rules are in :mod:`lossreduce.rules`, and the round table decides.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from lossreduce.v2 import coordinator_pb2 as pb

__all__ = ["DIGEST_SIZE", "Contribution", "contribution_digest", "own_digests"]

DIGEST_SIZE: Final = 8
"""Bytes of one contribution's digest (a journal's round record, an aggregate's
``covered_digests``)."""


@dataclass(frozen=True, slots=True)
class Contribution:
    """One request for one round: a partial per term, in the sender's own order."""

    rank: int
    world_size: int
    terms: tuple[str, ...]
    values: tuple[float, ...]
    contracts: tuple[str, ...]
    covers: tuple[int, ...] = ()
    """Hierarchical aggregation: every rank this one contribution counts for (strictly
    increasing, ``rank`` first); empty for a single rank's contribution."""
    expansions: tuple[tuple[float, ...], ...] = ()
    """Aggregated only, per term: the exact sum of the covered ranks' partials as a
    non-overlapping expansion (``values`` holds the rounded sums)."""
    zero_ranks: tuple[int, ...] = ()
    """Aggregated only, per term: how many covered ranks sent 0."""
    run: str = ""
    """The run the contribution belongs to (every covered rank's); empty from a client
    that names no run."""
    rank_digests: tuple[bytes, ...] = ()
    """Aggregated only: :func:`contribution_digest` of each covered rank's own
    contribution, in ``covers`` order; empty from an aggregator that predates them."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this contribution counts for."""
        return self.covers or (self.rank,)

    @classmethod
    def from_request(cls, request: pb.ReduceRequest) -> Contribution:
        """The contribution a request carries (its round key travels beside it)."""
        # One conversion of the repeated field to Python objects, then a list
        # comprehension per column: the cheapest way through upb's wrappers, and
        # this runs for every message the coordinator receives.
        parts = list(request.partials)
        covers = tuple(request.covered_ranks)  # hierarchical aggregation; () for one rank
        return cls(
            request.rank,
            request.world_size,
            tuple([p.term for p in parts]),
            tuple([p.value for p in parts]),
            tuple([p.contract for p in parts]),
            covers,
            tuple([tuple(p.expansion) for p in parts]) if covers else (),
            tuple([p.zero_ranks for p in parts]) if covers else (),
            request.run,
            tuple(request.covered_digests) if covers else (),
        )

    def request(self, key: pb.RoundKey) -> pb.ReduceRequest:
        """This contribution as the ``ReduceRequest`` for round ``key``."""
        request = pb.ReduceRequest(rank=self.rank, world_size=self.world_size, run=self.run)
        request.round.CopyFrom(key)
        # Filled in place: building a TermPartial per term and then the request
        # from the list costs the client about twice as much per round.
        add = request.partials.add
        if self.covers:
            request.covered_ranks.extend(self.covers)
            request.covered_digests.extend(self.rank_digests)
            for t, v, c, e, z in zip(
                self.terms,
                self.values,
                self.contracts,
                self.expansions,
                self.zero_ranks,
                strict=True,
            ):
                add(term=t, value=v, contract=c, expansion=e, zero_ranks=z)
        else:
            for t, v, c in zip(self.terms, self.values, self.contracts, strict=True):
                add(term=t, value=v, contract=c)
        return request


def contribution_digest(c: Contribution) -> bytes:
    """``DIGEST_SIZE`` bytes identifying ``c`` exactly (what a re-send is compared
    against); never all zeros. The run is not part of it: runs are judged first."""
    # repr round-trips every float exactly; + 0.0 makes -0.0 equal 0.0, as == does.
    text = repr(
        (
            c.rank,
            c.world_size,
            c.terms,
            tuple([v + 0.0 for v in c.values]),
            c.contracts,
            c.covers,
            c.expansions,
            c.zero_ranks,
        )
    )
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=DIGEST_SIZE).digest()
    return digest if any(digest) else b"\x01" * DIGEST_SIZE


def own_digests(c: Contribution) -> dict[int, bytes]:
    """Each rank ``c`` counts for, and the digest of that rank's own contribution.

    A single rank's is :func:`contribution_digest`; an aggregate's come from its
    ``rank_digests``. An aggregate without them (an older aggregator) can only be
    matched whole, so every covered rank gets the aggregate's own digest.
    """
    if not c.covers:
        return {c.rank: contribution_digest(c)}
    if len(c.rank_digests) == len(c.covers):
        return dict(zip(c.covers, c.rank_digests, strict=True))
    whole = contribution_digest(c)
    return dict.fromkeys(c.covers, whole)
