"""The round journal as the round table's :class:`~lossreduce.server.outcomes.OutcomeStore`.

The table calls :meth:`JournalOutcomeStore.put` inside ``_finish``, before the
outcome becomes visible to any rank, and :meth:`JournalOutcomeStore.get` when
a contribution arrives for a round it does not know (after a restart).

An outcome is stored as a small JSON document: floats as ``float.hex`` (exact,
NaN and infinities included) and errors as the serialized ``google.rpc.Status``
the ranks receive (:func:`lossreduce.status_codec.to_status`), so an answer rebuilt
from the journal is the identical answer, down to the bytes on the wire.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from lossreduce.errors import InvalidPartialError, LossReduceError
from lossreduce.status_codec import from_status, to_status

from .journal import JournalError, JournalRecord, RoundJournal
from .outcomes import DIGEST_SIZE, Outcome, OutcomeKind, RoundKey, RoundRecord, TermNormalizerValue
from .run_claims import ClaimRecord

__all__ = ["JournalOutcomeStore", "decode_outcome", "encode_outcome"]

_log = logging.getLogger(__name__)

_FORMAT = 2
"""2 adds the round's ``record`` (contract and per-rank digests); 1 is still read."""
_READABLE_FORMATS = (1, 2)


def _encode_error(err: LossReduceError | None) -> str | None:
    if err is None:
        return None
    return base64.b64encode(to_status(err).SerializeToString()).decode("ascii")


def _decode_error(text: str | None) -> LossReduceError | None:
    if text is None:
        return None
    return from_status(status_pb2.Status.FromString(base64.b64decode(text)))


def _encode_record(record: RoundRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "rank": record.reference_rank,
        "world_size": record.world_size,
        "terms": list(record.terms),
        "contracts": list(record.contracts),
        "digests": base64.b64encode(record.digests).decode("ascii"),
    }


def _decode_record(doc: dict[str, Any] | None) -> RoundRecord | None:
    if doc is None:
        return None
    record = RoundRecord(
        reference_rank=int(doc["rank"]),
        world_size=int(doc["world_size"]),
        terms=tuple(str(t) for t in doc["terms"]),
        contracts=tuple(str(c) for c in doc["contracts"]),
        digests=base64.b64decode(doc["digests"], validate=True),
    )
    if len(record.contracts) != len(record.terms) or not record.terms:
        raise ValueError(
            f"record has terms {list(record.terms)} and {len(record.contracts)} contracts"
        )
    if not 0 <= record.reference_rank < record.world_size:
        raise ValueError(
            f"record has rank {record.reference_rank} of world_size {record.world_size}"
        )
    if len(record.digests) != record.world_size * DIGEST_SIZE:
        raise ValueError(
            f"record has {len(record.digests)} digest bytes for world_size {record.world_size}"
        )
    return record


def encode_outcome(outcome: Outcome) -> bytes:
    """The journal payload of ``outcome`` (its key is stored in the journal's columns)."""
    doc: dict[str, Any] = {
        "format": _FORMAT,
        "kind": outcome.kind.value,
        "normalizers": [[n.term, n.value.hex(), n.zero_ranks] for n in outcome.normalizers],
        "error": _encode_error(outcome.error),
        "culprit": _encode_error(outcome.culprit),
        "record": _encode_record(outcome.record),
    }
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def decode_outcome(key: RoundKey, payload: bytes) -> Outcome:
    """Rebuild the outcome of ``key`` from its journal payload."""
    where = f"job {key.job!r} group {key.group!r} step {key.step}"
    try:
        doc = json.loads(payload)
        if doc.get("format") not in _READABLE_FORMATS:
            raise ValueError(f"unknown payload format {doc.get('format')!r}")
        culprit = _decode_error(doc["culprit"])
        if culprit is not None and not isinstance(culprit, InvalidPartialError):
            raise ValueError(f"culprit error is a {type(culprit).__name__}")
        return Outcome(
            key=key,
            kind=OutcomeKind(doc["kind"]),
            normalizers=tuple(
                TermNormalizerValue(str(term), float.fromhex(value), int(zero_ranks))
                for term, value, zero_ranks in doc["normalizers"]
            ),
            error=_decode_error(doc["error"]),
            culprit=culprit,
            record=_decode_record(doc["record"]) if doc["format"] >= 2 else None,
        )
    except (ValueError, KeyError, TypeError, DecodeError) as exc:
        raise JournalError(f"the journaled outcome of {where} is unreadable: {exc}") from exc


class JournalOutcomeStore:
    """Persists every finished round's outcome in a :class:`RoundJournal`."""

    def __init__(self, journal: RoundJournal, *, clock: Callable[[], float] = time.time) -> None:
        self.journal = journal
        self._clock = clock
        self.failed_writes = 0
        """Outcomes answered although the journal could not be written."""

    def put(self, outcome: Outcome) -> None:
        """Commit ``outcome``; returns once it is in the journal.

        If the journal cannot be written (disk full, file removed), the round
        is still answered: ranks waiting on it must not hang. That round is
        then not durable, which is logged as an error and counted in
        :attr:`failed_writes`.
        """
        key = outcome.key
        record = JournalRecord(key.job, key.group, key.step, self._clock(), encode_outcome(outcome))
        try:
            self.journal.put(record)
        except JournalError as exc:
            self.failed_writes += 1
            _log.error(
                "job %r group %r step %d: %s; answering the round anyway, without durability",
                key.job,
                key.group,
                key.step,
                exc,
            )

    def get(self, key: RoundKey) -> Outcome | None:
        """The journaled outcome of a round finished before this coordinator started."""
        payload = self.journal.lookup(key.job, key.group, key.step)
        return None if payload is None else decode_outcome(key, payload)

    # -- ClaimStore (lossreduce.server.run_claims) ---------------------------------

    def put_claim(self, record: ClaimRecord) -> None:
        """Journal the group's new holder; a failed write is logged, not raised (the
        claim still holds in memory, only not across a restart)."""
        try:
            self.journal.put_claim(
                record.job, record.group, record.run, record.since, record.newest_step
            )
        except JournalError as exc:
            self.failed_writes += 1
            _log.error("%s; the claim holds until this coordinator stops", exc)

    def drop_claim(self, job: str, group: str) -> None:
        """Forget the group's holder in the journal."""
        try:
            self.journal.drop_claim(job, group)
        except JournalError as exc:
            self.failed_writes += 1
            _log.error("%s; the retention pass deletes it later", exc)

    def claims(self) -> list[ClaimRecord]:
        """The holders the journal kept (read once, when the round table starts)."""
        return [ClaimRecord(*row) for row in self.journal.claims()]
