"""The journal as the round table's outcome store: exact codec, answers across a restart."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status

from lossreduce.contribution import Contribution
from lossreduce.errors import (
    ConflictingContributionError,
    ContractMismatchError,
    InvalidPartialError,
    RoundAbortedError,
    RoundTimeoutError,
)
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.server.journal import JournalError, JournalRecord, JournalSettings, RoundJournal
from lossreduce.server.journal_store import JournalOutcomeStore, decode_outcome, encode_outcome
from lossreduce.server.outcomes import (
    Outcome,
    OutcomeKind,
    RoundKey,
    RoundRecord,
    TermNormalizerValue,
)
from lossreduce.status_codec import from_status, to_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

KEY = RoundKey("job", "actor", 12)


def _outcomes() -> list[Outcome]:
    culprit = InvalidPartialError(
        "rank 2 sent nan",
        job="job",
        group="actor",
        step=12,
        rank=2,
        terms=["kl"],
        values=[math.nan],
    )
    return [
        Outcome(
            KEY,
            OutcomeKind.COMPLETED,
            normalizers=(
                TermNormalizerValue("tokens", 0.1 + 0.2, 0),
                TermNormalizerValue("groups", 5e-324, 3),
                TermNormalizerValue("big", 1.7976931348623157e308, 1),
            ),
        ),
        Outcome(
            KEY,
            OutcomeKind.ABORTED_INVALID,
            error=RoundAbortedError(
                "aborted by rank 2", job="job", group="actor", step=12, ranks=[2], values=[math.nan]
            ),
            culprit=culprit,
        ),
        Outcome(
            KEY,
            OutcomeKind.ABORTED_TIMEOUT,
            error=RoundTimeoutError("ranks [1, 3] missing", job="job", step=12, ranks=[1, 3]),
        ),
    ]


@pytest.mark.parametrize("outcome", _outcomes(), ids=lambda o: o.kind.value)
def test_an_outcome_survives_the_codec_exactly(outcome: Outcome) -> None:
    restored = decode_outcome(KEY, encode_outcome(outcome))
    assert restored.kind is outcome.kind
    assert [(n.term, n.value.hex(), n.zero_ranks) for n in restored.normalizers] == [
        (n.term, n.value.hex(), n.zero_ranks) for n in outcome.normalizers
    ]
    for before, after in ((outcome.error, restored.error), (outcome.culprit, restored.culprit)):
        if before is None:
            assert after is None
            continue
        assert after is not None
        assert type(after) is type(before)
        # What a rank receives is byte-for-byte the same.
        assert to_status(after).SerializeToString() == to_status(before).SerializeToString()


@pytest.mark.parametrize("payload", [b"not json", b'{"format": 99}', b'{"format": 1}'])
def test_an_unreadable_payload_names_the_round(payload: bytes) -> None:
    with pytest.raises(JournalError, match="job 'job' group 'actor' step 12"):
        decode_outcome(KEY, payload)


def test_the_store_answers_rounds_from_before_the_restart(tmp_path: Path) -> None:
    settings = JournalSettings(path=tmp_path / "j.sqlite3")
    with RoundJournal(settings) as journal:
        JournalOutcomeStore(journal).put(_outcomes()[0])
    with RoundJournal(settings) as journal:
        store = JournalOutcomeStore(journal)
        restored = store.get(KEY)
        assert restored is not None
        assert restored.normalizers == _outcomes()[0].normalizers
        assert store.get(KEY._replace(step=13)) is None
        assert [r.step for r in journal.records()] == [12]


def test_a_journal_that_cannot_be_written_does_not_block_the_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = RoundJournal(JournalSettings(path=tmp_path / "j.sqlite3")).open()
    store = JournalOutcomeStore(journal)
    journal.close()  # e.g. the disk went away underneath
    with caplog.at_level(logging.ERROR, logger="lossreduce.server.journal_store"):
        store.put(_outcomes()[0])
    assert store.failed_writes == 1
    assert "answering the round anyway" in caplog.text
    assert "job 'job' group 'actor' step 12" in caplog.text


# -- a coordinator restarted on its journal -------------------------------------------


@pytest.fixture
def journal_path(tmp_path: Path) -> Path:
    return tmp_path / "journal.sqlite3"


@pytest.fixture
def restartable(journal_path: Path) -> Iterator[object]:
    """Start coordinators one after the other on the same journal and port."""
    running: list[tuple[CoordinatorThread, RoundJournal]] = []

    def start(port: int = 0, round_timeout_s: float = 5.0) -> CoordinatorThread:
        journal = RoundJournal(JournalSettings(path=journal_path)).open()
        settings = CoordinatorSettings(
            host="127.0.0.1",
            port=port,
            metrics_port=None,
            round_timeout_s=round_timeout_s,
            shutdown_grace_s=0.1,
        )
        coord = CoordinatorThread(settings, store=JournalOutcomeStore(journal)).start()
        running.append((coord, journal))
        return coord

    def stop_all() -> None:
        while running:
            coord, journal = running.pop()
            coord.stop(0.1)
            journal.close()

    start.stop_all = stop_all  # type: ignore[attr-defined]
    yield start
    stop_all()


def _request(rank: int, step: int, world_size: int = 2) -> pb.ReduceRequest:
    contribution = Contribution(
        rank,
        world_size,
        ("tokens", "groups"),
        (0.1 * (rank + 1), float(rank)),
        ("mean:token_mean", "mean:prompt_mean"),
    )
    return contribution.request(pb.RoundKey(job="job", group="actor", step=step))


def _reduce_all(target: str, step: int, ranks: range) -> list[bytes]:
    answers: dict[int, bytes] = {}

    def one(rank: int) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.ReductionCoordinatorStub(channel)
            answers[rank] = stub.Reduce(_request(rank, step), timeout=10).SerializeToString()

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [answers[r] for r in ranks]


def test_a_retry_after_a_restart_gets_the_identical_answer(restartable) -> None:
    first = restartable()
    answers = _reduce_all(first.target, 0, range(2))
    assert answers[0] == answers[1]
    port = first.port
    restartable.stop_all()

    second = restartable(port=port, round_timeout_s=30.0)
    # Rank 1 never saw its answer and retries alone: with nothing remembered it
    # would open a fresh round and wait 30 s for a rank 0 that already moved on.
    with grpc.insecure_channel(second.target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        retried = stub.Reduce(_request(1, 0), timeout=10)
        status = stub.GetRound(pb.GetRoundRequest(round=_request(1, 0).round), timeout=10)
    assert retried.SerializeToString() == answers[1]
    # The restored outcome answered the retry; no new round was opened for step 0.
    assert status.state == pb.ROUND_STATE_UNKNOWN


def test_a_straggler_after_a_restart_gets_the_timeout_it_missed(restartable) -> None:
    first = restartable(round_timeout_s=0.3)
    with grpc.insecure_channel(first.target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Reduce(_request(0, 5), timeout=10)
    assert info.value.code() is grpc.StatusCode.ABORTED
    port = first.port
    restartable.stop_all()

    second = restartable(port=port, round_timeout_s=30.0)
    with grpc.insecure_channel(second.target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as late:
            stub.Reduce(_request(1, 5), timeout=10)
    assert late.value.code() is grpc.StatusCode.ABORTED
    err = from_status(rpc_status.from_call(late.value))
    assert isinstance(err, RoundTimeoutError)
    assert err.missing_ranks == (1,)
    assert err.message == from_status(rpc_status.from_call(info.value)).message


def test_a_journal_record_is_committed_before_the_answer(
    restartable, journal_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_at_answer: list[list[int]] = []
    coord = restartable()
    journal = RoundJournal(JournalSettings(path=journal_path)).open()
    try:
        original = RoundJournal.put

        def spy(self: RoundJournal, record: JournalRecord) -> None:
            original(self, record)
            seen_at_answer.append([r.step for r in journal.records()])

        monkeypatch.setattr(RoundJournal, "put", spy)
        _reduce_all(coord.target, 7, range(2))
        # A second connection already reads the committed round when put() returns.
        assert seen_at_answer == [[7]]
    finally:
        journal.close()


def test_an_outcome_keeps_its_record_through_the_codec() -> None:
    record = RoundRecord(
        reference_rank=1,
        world_size=3,
        terms=("tokens", "groups"),
        contracts=("mean:token_mean", "mean:prompt_mean"),
        digests=bytes(range(1, 9)) + bytes(8) + bytes(range(9, 17)),
    )
    outcome = Outcome(KEY, OutcomeKind.COMPLETED, normalizers=_outcomes()[0].normalizers)
    restored = decode_outcome(KEY, encode_outcome(dataclasses.replace(outcome, record=record)))
    assert restored.record == record
    assert restored.record.digest_of(0) == bytes(range(1, 9))
    assert restored.record.digest_of(1) is None  # did not arrive
    assert restored.record.digest_of(3) is None  # outside the world
    assert decode_outcome(KEY, encode_outcome(outcome)).record is None


def test_a_payload_of_the_previous_format_is_still_read() -> None:
    doc = json.loads(encode_outcome(_outcomes()[0]))
    del doc["record"]
    doc["format"] = 1
    restored = decode_outcome(KEY, json.dumps(doc).encode())
    assert restored.normalizers == _outcomes()[0].normalizers
    assert restored.record is None


def test_a_record_that_does_not_fit_its_world_size_is_unreadable() -> None:
    doc = json.loads(encode_outcome(_outcomes()[0]))
    doc["record"] = {
        "rank": 0,
        "world_size": 2,
        "terms": ["tokens"],
        "contracts": [""],
        "digests": base64.b64encode(bytes(8)).decode(),
    }
    with pytest.raises(
        JournalError, match=r"job 'job' group 'actor' step 12 is unreadable: .*8 digest bytes"
    ):
        decode_outcome(KEY, json.dumps(doc).encode())


def test_after_a_restart_a_rank_resending_other_partials_or_terms_is_refused(restartable) -> None:
    first = restartable()
    answers = _reduce_all(first.target, 3, range(2))
    port = first.port
    restartable.stop_all()

    second = restartable(port=port)
    changed = _request(1, 3)
    changed.partials[0].value = 99.0
    other_terms = _request(1, 3)
    other_terms.partials[1].term = "kl"
    late = _request(2, 3, world_size=3)
    with grpc.insecure_channel(second.target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        refused = []
        for request in (changed, other_terms, late):
            with pytest.raises(grpc.RpcError) as info:
                stub.Reduce(request, timeout=10)
            refused.append((info.value.code(), from_status(rpc_status.from_call(info.value))))
        # One stream: the refused request does not end it; the identical retry behind it
        # gets the answer from before the restart.
        streamed = list(stub.ReduceStream(iter([late, _request(1, 3)]), timeout=10))
    (c1, conflict), (c2, conflict_terms), (c3, mismatch) = refused
    assert (c1, c2, c3) == (
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert isinstance(conflict, ConflictingContributionError)
    assert conflict.message.startswith("job 'job' group 'actor' step 3: rank 1 already ")
    assert "now sent 'tokens'=99.0" in conflict.message
    assert isinstance(conflict_terms, ConflictingContributionError)
    assert isinstance(mismatch, ContractMismatchError)
    assert "rank 2 sent world_size 3 but rank" in mismatch.message
    assert len(streamed) == 2
    assert isinstance(from_status(streamed[0].error), ContractMismatchError)
    assert streamed[1].SerializeToString() == answers[1]
