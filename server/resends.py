"""Whether a contribution re-sends ranks a round already counted, judged per rank.

A rank's request may reach the coordinator more than once: a client retries, a
node agent re-sends over a new stream, or a restarted agent (or one whose
deadline passed) groups the retrying ranks of a round differently than the
first time. An aggregate carries the digest of each covered rank's own
contribution (``covered_digests``), so the judgement is per rank whatever the
grouping: every rank counted and identical is a retry (it gets the round's one
answer), a rank whose digest differs is a conflict naming it, and a mix of
counted and new ranks in one aggregate is refused so the node sends them alone.
Pure: the round table looks the counted digests up and acts on the verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lossreduce._compat import StrEnum
from lossreduce.contribution import Contribution, own_digests

__all__ = ["Resend", "ResendKind", "judge_resend"]


class ResendKind(StrEnum):
    NEW = "new"
    """None of its ranks was counted: a fresh contribution."""
    RETRY = "retry"
    """Every rank was counted with an identical contribution: answer it as the round ends."""
    CHANGED = "changed"
    """A counted rank now sends other partials: refused, naming ``rank``."""
    MIXED = "mixed"
    """Some ranks counted (identically) and some not: refused; each should go alone."""


@dataclass(frozen=True, slots=True)
class Resend:
    kind: ResendKind
    rank: int | None = None
    """CHANGED: the first rank whose contribution differs."""
    counted: tuple[int, ...] = ()
    """MIXED: the ranks already counted."""
    new: tuple[int, ...] = ()
    """MIXED: the ranks not counted yet."""


def judge_resend(c: Contribution, counted_digest: Callable[[int], bytes | None]) -> Resend:
    """Judge ``c`` against ``counted_digest(rank)``: the digest of the rank's own
    contribution the round counted, or None when that rank has not arrived."""
    counted = {r: d for r in c.ranks if (d := counted_digest(r)) is not None}
    if not counted:
        return Resend(ResendKind.NEW)
    mine = own_digests(c)
    for rank, digest in counted.items():
        if mine[rank] != digest:
            return Resend(ResendKind.CHANGED, rank=rank)
    if len(counted) == len(c.ranks):
        return Resend(ResendKind.RETRY)
    return Resend(
        ResendKind.MIXED,
        counted=tuple(counted),
        new=tuple(r for r in c.ranks if r not in counted),
    )
