"""What a finished round keeps for a restarted coordinator, and how it comes back.

An outcome handed to the :class:`~lossreduce.server.outcomes.OutcomeStore`
carries a :class:`~lossreduce.server.outcomes.RoundRecord`: the round's
contract and one digest per rank of the contribution that counted for it. A
coordinator restarted on the store rebuilds the round from it, so a re-sent
contribution is answered identically when it is the one that counted and
refused as a conflict when it differs.
"""

from __future__ import annotations

from collections.abc import Sequence

from lossreduce.contribution import DIGEST_SIZE, Contribution

from .outcomes import RoundRecord

__all__ = ["record_of", "restored_reference"]


def record_of(reference: Contribution, digests: Sequence[bytes | None]) -> RoundRecord:
    """What the store keeps of a round opened by ``reference`` whose rank ``r`` sent a
    contribution with digest ``digests[r]`` (None when it did not arrive)."""
    empty = bytes(DIGEST_SIZE)
    return RoundRecord(
        reference.rank,
        reference.world_size,
        reference.terms,
        reference.contracts,
        b"".join([empty if d is None else d for d in digests]),
    )


def restored_reference(record: RoundRecord | None) -> Contribution:
    """The first contribution of a round rebuilt from ``record``: its contract without
    values (world size 0 and no terms when the journal predates records)."""
    if record is None:
        return Contribution(rank=0, world_size=0, terms=(), values=(), contracts=())
    return Contribution(
        rank=record.reference_rank,
        world_size=record.world_size,
        terms=record.terms,
        values=(),
        contracts=record.contracts,
    )
