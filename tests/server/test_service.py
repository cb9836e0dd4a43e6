"""The coordinator over real gRPC: every row of the outcome table, from many
concurrent threads, over unary Reduce and over ReduceStream, with raw stubs."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import grpc
import pytest
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lossreduce.errors import (
    ConflictingContributionError,
    ContractMismatchError,
    CoordinatorUnavailableError,
    EmptyNormalizerError,
    InvalidPartialError,
    LimitExceededError,
    RoundAbortedError,
    RoundTimeoutError,
    StaleRoundError,
)
from lossreduce.server import SERVICE_NAME, CoordinatorSettings, CoordinatorThread
from lossreduce.server.outcomes import RoundKey
from lossreduce.server.round_table import Contribution, RoundTable
from lossreduce.server.servicer import _answer
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb
from tests.raw_stub import CALL_TIMEOUT_S, Ranks, Received, Send

MODES = ["unary", "stream"]
WAIT_BOUND_S = 30.0
"""Longest wait for something already on its way; only reached when a test fails."""
T = TypeVar("T")


@pytest.mark.parametrize("mode", MODES)
def test_completed_round_gives_every_rank_the_same_exact_normalizers(
    ranks: Ranks, mode: str
) -> None:
    world = 16
    tokens = [float(3 * r + 1) * 0.1 for r in range(world)]
    groups = [0.0 if r % 4 else 1.0 for r in range(world)]
    sends = [
        Send(rank=r, world_size=world, partials={"tokens": tokens[r], "groups": groups[r]})
        for r in reversed(range(world))
    ]
    answers = ranks.round(sends, mode)
    expected = {"tokens": (math.fsum(tokens), 0), "groups": (4.0, world - 4)}
    for received in answers:
        assert received.code == code_pb2.OK
        assert received.normalizers == expected
        assert isinstance(received.answer, pb.ReduceResponse)
        assert [n.term for n in received.answer.normalizers] == ["tokens", "groups"]
        assert received.answer.round.step == 1


@pytest.mark.parametrize("mode", MODES)
def test_empty_global_normalizer_fails_every_rank(ranks: Ranks, mode: str) -> None:
    sends = [Send(rank=r, world_size=3, partials={"tokens": 0.0, "seqs": 1.0}) for r in range(3)]
    for received in ranks.round(sends, mode):
        assert received.code == code_pb2.FAILED_PRECONDITION
        err = received.error
        assert isinstance(err, EmptyNormalizerError)
        assert (err.job, err.group, err.step, err.terms, err.values) == (
            "job-t",
            "actor",
            1,
            ("tokens",),
            (0.0,),
        )
        assert "job 'job-t' group 'actor' step 1" in err.message
        assert "'tokens'=0.0" in err.message


@pytest.mark.parametrize("mode", MODES)
def test_invalid_partial_culprit_gets_invalid_argument_the_rest_aborted(
    ranks: Ranks, mode: str
) -> None:
    world = 6
    sends = [
        Send(rank=r, world_size=world, partials={"tokens": math.nan if r == 4 else 1.0})
        for r in range(world)
    ]
    answers = ranks.round(sends, mode)
    for rank, received in enumerate(answers):
        err = received.error
        if rank == 4:
            assert received.code == code_pb2.INVALID_ARGUMENT
            assert isinstance(err, InvalidPartialError)
            assert (err.rank, err.terms) == (4, ("tokens",))
            assert math.isnan(err.values[0])
            assert "rank 4 sent invalid partial 'tokens'=nan" in err.message
        else:
            assert received.code == code_pb2.ABORTED
            assert type(err) is RoundAbortedError
            assert err.culprit_rank == 4
            assert "aborted because rank 4" in err.message
    # A rank arriving after the abort learns it at once, not at the timeout.
    late = ranks.unary(Send(rank=0, world_size=world, partials={"tokens": 1.0}, step=1))
    assert late.code == code_pb2.ABORTED


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("culprit", "phrase"),
    [
        (Send(rank=1, world_size=3, partials={"tokens": 1.0}), "sent world_size 3 but rank 0"),
        (Send(rank=1, world_size=2, partials={"kl": 1.0}), "sent terms ['kl'] but rank 0"),
        (
            Send(
                rank=1, world_size=2, partials={"tokens": 1.0}, contracts={"tokens": "sum:constant"}
            ),
            "sent contract 'sum:constant' for term 'tokens' but rank 0 sent 'mean:token_mean'",
        ),
    ],
)
def test_contract_mismatch_fails_every_rank(
    ranks: Ranks, mode: str, culprit: Send, phrase: str
) -> None:
    first = Send(rank=0, world_size=2, partials={"tokens": 1.0})
    # Rank 0 must arrive first to be the reference; it then waits on its own thread.
    waiter = threading.Thread(target=lambda: results.append(ranks.unary(first)))
    results: list[Received] = []
    waiter.start()
    _wait_until_arrived(ranks, first, 1)
    second = ranks.unary(culprit) if mode == "unary" else ranks.stream([culprit])[0]
    waiter.join()
    for received in (results[0], second):
        assert received.code == code_pb2.FAILED_PRECONDITION
        assert isinstance(received.error, ContractMismatchError)
        assert phrase in received.error.message
        assert received.error.ranks == (0, 1)


def _eventually(probe: Callable[[], T | None], what: str) -> T:
    """``probe()``'s first non-None value, polled every 10 ms for at most ``WAIT_BOUND_S``."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while (value := probe()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {WAIT_BOUND_S} s for {what}")
        time.sleep(0.01)
    return value


def _wait_until_arrived(ranks: Ranks, send: Send, count: int) -> pb.RoundStatus:
    key = pb.RoundKey(job=send.job, group=send.group, step=send.step)

    def arrived() -> pb.RoundStatus | None:
        status: pb.RoundStatus = ranks.stub.GetRound(
            pb.GetRoundRequest(round=key), timeout=CALL_TIMEOUT_S
        )
        return status if len(status.arrived_ranks) >= count else None

    return _eventually(arrived, f"{count} ranks of {key}")


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 0.3}], indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_round_timeout_names_every_missing_rank(ranks: Ranks, mode: str) -> None:
    sends = [Send(rank=r, world_size=5, partials={"tokens": 1.0}) for r in (1, 3)]
    for received in ranks.round(sends, mode):
        assert received.code == code_pb2.ABORTED
        err = received.error
        assert isinstance(err, RoundTimeoutError)
        assert err.missing_ranks == (0, 2, 4)
        assert "waiting for ranks [0, 2, 4]" in err.message
    # A missing rank that finally arrives gets the same ending.
    late = ranks.unary(Send(rank=0, world_size=5, partials={"tokens": 1.0}))
    assert isinstance(late.error, RoundTimeoutError)


@pytest.mark.parametrize("mode", MODES)
def test_retries_get_the_same_outcome_and_conflicts_already_exists(ranks: Ranks, mode: str) -> None:
    sends = [Send(rank=r, world_size=2, partials={"tokens": 1.0 + r}) for r in range(2)]
    first = ranks.round(sends, mode)
    retry = ranks.round(sends, mode)
    assert [r.normalizers for r in retry] == [r.normalizers for r in first]
    assert first[0].normalizers == {"tokens": (3.0, 0)}
    changed = Send(rank=1, world_size=2, partials={"tokens": 5.0})
    conflict = ranks.unary(changed) if mode == "unary" else ranks.stream([changed])[0]
    assert conflict.code == code_pb2.ALREADY_EXISTS
    assert isinstance(conflict.error, ConflictingContributionError)
    assert "already contributed 'tokens'=2.0" in conflict.error.message
    assert "now sent 'tokens'=5.0" in conflict.error.message


def test_retry_while_waiting_is_not_counted_twice(ranks: Ranks) -> None:
    send0 = Send(rank=0, world_size=2, partials={"tokens": 1.0})
    results: list[Received] = []
    threads = [threading.Thread(target=lambda: results.append(ranks.unary(send0))) for _ in "ab"]
    for t in threads:
        t.start()
    status = _wait_until_arrived(ranks, send0, 1)
    assert list(status.missing_ranks) == [1]
    last = ranks.unary(Send(rank=1, world_size=2, partials={"tokens": 2.0}))
    for t in threads:
        t.join()
    assert [r.normalizers for r in [*results, last]] == [{"tokens": (3.0, 0)}] * 3


@pytest.mark.parametrize(
    "coordinator",
    [{"retained_steps": 4, "max_rounds_in_flight": 2, "max_terms": 2, "max_world_size": 8}],
    indirect=True,
)
def test_stale_steps_and_limits(ranks: Ranks) -> None:
    ranks.unary(Send(rank=0, world_size=1, partials={"t": 1.0}, step=10))
    stale = ranks.unary(Send(rank=0, world_size=1, partials={"t": 1.0}, step=6))
    assert stale.code == code_pb2.FAILED_PRECONDITION
    assert isinstance(stale.error, StaleRoundError)
    assert stale.error.limit == "retained_steps"

    cases = [
        (Send(rank=0, world_size=1, partials={"a": 1.0, "b": 1.0, "c": 1.0}), "max_terms"),
        (Send(rank=0, world_size=9, partials={"a": 1.0}), "max_world_size"),
    ]
    for send, limit in cases:
        received = ranks.unary(send)
        assert received.code == code_pb2.RESOURCE_EXHAUSTED
        assert isinstance(received.error, LimitExceededError)
        assert received.error.limit == limit

    # Two rounds may be in flight; the third is refused, in another stream too.
    pipelined = [Send(rank=0, world_size=2, partials={"t": 1.0}, step=s) for s in (11, 12)]
    responses = ranks.stub.ReduceStream(iter([p.request() for p in pipelined]), timeout=5.0)
    _wait_until_arrived(ranks, pipelined[1], 1)
    third = ranks.unary(Send(rank=0, world_size=2, partials={"t": 1.0}, step=13))
    assert isinstance(third.error, LimitExceededError)
    assert third.error.limit == "max_rounds_in_flight"
    ranks.round(
        [Send(rank=1, world_size=2, partials={"t": 1.0}, step=s) for s in (11, 12)], "unary"
    )
    assert [ranks.decode(r).normalizers for r in responses] == [{"t": (2.0, 0)}] * 2


def test_stream_answers_in_request_order_and_survives_failed_rounds(ranks: Ranks) -> None:
    # Rank 0 pipelines three steps on one stream; step 2 will fail.
    mine = [
        Send(rank=0, world_size=2, partials={"t": 1.0}, step=1),
        Send(rank=0, world_size=2, partials={"t": 0.0}, step=2),
        Send(rank=0, world_size=2, partials={"t": 3.0}, step=3),
    ]
    results: list[Received] = []
    stream = threading.Thread(target=lambda: results.extend(ranks.stream(mine)))
    stream.start()
    _wait_until_arrived(ranks, mine[2], 1)
    # The peer completes the rounds in reverse order.
    for step, value in ((3, 4.0), (2, 0.0), (1, 2.0)):
        ranks.unary(Send(rank=1, world_size=2, partials={"t": value}, step=step))
    stream.join()
    assert [r.code for r in results] == [code_pb2.OK, code_pb2.FAILED_PRECONDITION, code_pb2.OK]
    assert results[0].normalizers == {"t": (3.0, 0)}
    assert isinstance(results[1].error, EmptyNormalizerError)
    assert results[2].normalizers == {"t": (7.0, 0)}


def test_terms_answered_in_each_requests_own_order(ranks: Ranks) -> None:
    a = Send(rank=0, world_size=2, partials={"x": 1.0, "y": 10.0})
    b = Send(rank=1, world_size=2, partials={"y": 20.0, "x": 2.0})
    first, second = ranks.round([a, b], "unary")
    assert isinstance(first.answer, pb.ReduceResponse)
    assert isinstance(second.answer, pb.ReduceResponse)
    assert [n.term for n in first.answer.normalizers] == ["x", "y"]
    assert [n.term for n in second.answer.normalizers] == ["y", "x"]
    assert first.normalizers == second.normalizers == {"x": (3.0, 0), "y": (30.0, 0)}


def test_jobs_and_groups_do_not_interact(ranks: Ranks) -> None:
    sends = [
        Send(rank=r, world_size=2, partials={"t": 1.0 + r + k}, job=job, group=group)
        for k, (job, group) in enumerate([("j1", "actor"), ("j1", "critic"), ("j2", "actor")])
        for r in range(2)
    ]
    answers = ranks.round(sends, "stream")
    assert [a.normalizers["t"][0] for a in answers] == [3.0, 3.0, 5.0, 5.0, 7.0, 7.0]


def test_get_round_and_list_rounds(ranks: Ranks) -> None:
    ranks.round(
        [Send(rank=r, world_size=2, partials={"t": 1.0}, step=1) for r in range(2)], "unary"
    )
    waiting = Send(rank=2, world_size=4, partials={"t": 2.5}, step=2)
    thread = threading.Thread(target=ranks.unary, args=(waiting,))
    before = time.monotonic()
    thread.start()
    status = _wait_until_arrived(ranks, waiting, 1)
    elapsed = time.monotonic() - before
    assert status.state == pb.ROUND_STATE_COLLECTING
    assert (list(status.arrived_ranks), list(status.missing_ranks)) == ([2], [0, 1, 3])
    assert [(n.term, n.value) for n in status.partial_sums] == [("t", 2.5)]
    assert status.world_size == 4
    # The coordinator runs in this process on the same monotonic clock: the round
    # opened after ``before``, so its age is positive and at most ``elapsed``.
    assert 0.0 < status.age_seconds <= elapsed

    listed = ranks.stub.ListRounds(pb.ListRoundsRequest(job="job-t"), timeout=CALL_TIMEOUT_S)
    assert [(s.round.step, s.state) for s in listed.rounds] == [
        (2, pb.ROUND_STATE_COLLECTING),
        (1, pb.ROUND_STATE_COMPLETED),
    ]
    none = ranks.stub.ListRounds(pb.ListRoundsRequest(job="other"), timeout=CALL_TIMEOUT_S)
    assert list(none.rounds) == []
    unknown = ranks.stub.GetRound(
        pb.GetRoundRequest(round=pb.RoundKey(job="job-t", group="actor", step=99)),
        timeout=CALL_TIMEOUT_S,
    )
    assert unknown.state == pb.ROUND_STATE_UNKNOWN

    ranks.round(
        [Send(rank=r, world_size=4, partials={"t": 0.0}, step=2) for r in (0, 1, 3)], "unary"
    )
    thread.join()
    done = _wait_until_arrived(ranks, waiting, 4)
    assert done.state == pb.ROUND_STATE_COMPLETED
    assert [(n.term, n.value, n.zero_ranks) for n in done.partial_sums] == [("t", 2.5, 3)]


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
    status: int = response.status
    return status


def test_health_and_reflection(coordinator: CoordinatorThread, ranks: Ranks) -> None:
    for service in ("", SERVICE_NAME):
        assert _health(ranks.channel, service) == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(ranks.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = stub.ServerReflectionInfo(iter([request]), timeout=CALL_TIMEOUT_S)
    names = {s.name for s in response.list_services_response.service}
    assert {"lossreduce.v2.ReductionCoordinator", "grpc.health.v1.Health"} <= names


def test_shutdown_drains_in_flight_rounds_and_refuses_new_ones(coordinator_factory) -> None:
    coord = coordinator_factory(shutdown_grace_s=1.0, round_timeout_s=60.0)
    ranks = Ranks(coord.target)
    finishing = Send(rank=0, world_size=2, partials={"t": 1.0}, step=1)
    abandoned = Send(rank=0, world_size=2, partials={"t": 1.0}, step=2)
    results: dict[int, Received] = {}
    waiters = [
        threading.Thread(target=lambda s=s: results.__setitem__(s.step, ranks.unary(s)))
        for s in (finishing, abandoned)
    ]
    for w in waiters:
        w.start()
    _wait_until_arrived(ranks, finishing, 1)
    _wait_until_arrived(ranks, abandoned, 1)

    stopper = threading.Thread(target=coord.stop)
    stopper.start()
    _eventually(
        lambda: _health(ranks.channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING or None,
        "the stopping coordinator to report NOT_SERVING",
    )
    assert _health(ranks.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    fresh = ranks.unary(Send(rank=0, world_size=2, partials={"t": 1.0}, step=3))
    assert fresh.code == code_pb2.UNAVAILABLE
    assert isinstance(fresh.error, CoordinatorUnavailableError)
    # An in-flight round may still complete during the grace period.
    completed = ranks.unary(Send(rank=1, world_size=2, partials={"t": 2.0}, step=1))
    assert completed.normalizers == {"t": (3.0, 0)}
    stopper.join()
    for w in waiters:
        w.join()
    ranks.close()
    assert results[1].normalizers == {"t": (3.0, 0)}
    gone = results[2]
    assert gone.code == code_pb2.UNAVAILABLE
    assert "shut down before ranks [1] arrived" in gone.error.message


def test_metrics_endpoint_exposes_every_coordinator_metric(
    coordinator: CoordinatorThread, ranks: Ranks
) -> None:
    ranks.round([Send(rank=r, world_size=2, partials={"t": float(r)}) for r in range(2)], "unary")
    ranks.unary(Send(rank=0, world_size=2, partials={"t": 7.0}))  # conflicting
    assert coordinator.metrics_url is not None
    with urllib.request.urlopen(coordinator.metrics_url, timeout=CALL_TIMEOUT_S) as page:
        text = page.read().decode()
    for line in (
        'lossreduce_rounds_total{group="actor",job="job-t",outcome="completed"} 1.0',
        'lossreduce_round_duration_seconds_count{group="actor",job="job-t"} 1.0',
        'lossreduce_straggler_wait_seconds_count{group="actor",job="job-t"} 1.0',
        'lossreduce_contributions_total{group="actor",job="job-t"} 2.0',
        'lossreduce_retries_deduplicated_total{group="actor",job="job-t"} 0.0',
        'lossreduce_rounds_in_flight{group="actor",job="job-t"} 0.0',
        'lossreduce_global_normalizer{group="actor",job="job-t",term="t"} 1.0',
        'lossreduce_zero_partial_ranks{group="actor",job="job-t",term="t"} 1.0',
        'lossreduce_rejected_partials_total{group="actor",job="job-t",reason="conflicting"} 1.0',
        'lossreduce_rpc_errors_total{code="ALREADY_EXISTS",method="Reduce"} 1.0',
    ):
        assert line in text, line
    assert "lossreduce_build_info{" in text


def test_a_rank_whose_call_expired_keeps_its_place_and_its_retry_is_deduplicated(
    coordinator: CoordinatorThread, ranks: Ranks
) -> None:
    send0 = Send(rank=0, world_size=2, partials={"tokens": 1.0})
    with pytest.raises(grpc.RpcError) as expired:
        ranks.stub.Reduce(send0.request(), timeout=0.2)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    status = _wait_until_arrived(ranks, send0, 1)
    assert list(status.arrived_ranks) == [0]
    # The retry and the last rank complete the round; the cancelled wait did not break it.
    retry, last = ranks.round(
        [send0, Send(rank=1, world_size=2, partials={"tokens": 2.0})], "unary"
    )
    assert retry.normalizers == last.normalizers == {"tokens": (3.0, 0)}
    assert coordinator.metrics_url is not None
    with urllib.request.urlopen(coordinator.metrics_url, timeout=CALL_TIMEOUT_S) as page:
        text = page.read().decode()
    assert 'lossreduce_contributions_total{group="actor",job="job-t"} 2.0' in text
    assert 'lossreduce_retries_deduplicated_total{group="actor",job="job-t"} 1.0' in text


def test_a_stream_that_expired_while_its_round_waited_breaks_nothing(ranks: Ranks) -> None:
    send0 = Send(rank=0, world_size=2, partials={"tokens": 1.5}, job="expired-stream")
    with pytest.raises(grpc.RpcError) as expired:
        list(ranks.stub.ReduceStream(iter([send0.request()]), timeout=0.2))
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert list(_wait_until_arrived(ranks, send0, 1).arrived_ranks) == [0]
    # The stream's parked wait was cancelled with it; the round still ends for everyone.
    retry, last = ranks.round(
        [send0, Send(rank=1, world_size=2, partials={"tokens": 2.0}, job="expired-stream")],
        "stream",
    )
    assert retry.normalizers == last.normalizers == {"tokens": (3.5, 0)}


def test_a_port_in_use_fails_start_with_a_clear_error(coordinator: CoordinatorThread) -> None:
    taken = CoordinatorThread(
        CoordinatorSettings(host="127.0.0.1", port=coordinator.port, metrics_port=None)
    )
    with pytest.raises(
        OSError, match=f"cannot bind the coordinator to 127.0.0.1:{coordinator.port}"
    ):
        taken.start()
    taken.stop()  # nothing running: a no-op


@pytest.mark.parametrize("mode", MODES)
def test_a_late_rank_that_disagrees_with_the_contract_is_refused_and_the_stream_lives(
    ranks: Ranks, mode: str
) -> None:
    done = ranks.round(
        [Send(rank=r, world_size=2, partials={"tokens": 1.0 + r}) for r in range(2)], mode
    )
    late = Send(rank=2, world_size=3, partials={"kl": 1.0})
    retry = Send(rank=0, world_size=2, partials={"tokens": 1.0})
    if mode == "unary":
        answers = [ranks.unary(late), ranks.unary(retry)]
    else:  # the identical retry is queued behind the refused request on one stream
        answers = ranks.stream([late, retry])
    refused, retried = answers
    assert refused.code == code_pb2.FAILED_PRECONDITION
    assert isinstance(refused.error, ContractMismatchError)
    # Either rank may have opened the round (both were sent at once).
    first = refused.error.ranks[0]
    assert refused.error.ranks == (first, 2)
    assert f"rank 2 sent world_size 3 but rank {first} sent world_size 2" in refused.error.message
    assert retried.code == code_pb2.OK
    assert retried.normalizers == done[0].normalizers == {"tokens": (3.0, 0)}


def test_an_answer_for_terms_the_round_never_had_is_an_error_not_a_crash() -> None:
    # The table refuses such a contribution itself; the servicer must not raise if one
    # ever reaches it (a raise kills the stream and every request queued behind it).
    table = RoundTable(CoordinatorSettings())
    key = RoundKey("job-t", "actor", 1)
    table.contribute(key, Contribution(0, 1, ("tokens",), (1.0,), ("",)), 0.0)
    rnd = table.lookup(key)
    assert rnd is not None
    assert rnd.outcome is not None
    response, abort_with = _answer(rnd, Contribution(0, 1, ("kl",), (1.0,), ("",)))
    assert abort_with is not None
    err = from_status(response.error)
    assert isinstance(err, ContractMismatchError)
    assert "rank 0 sent terms ['kl'] but the round completed with terms ['tokens']" in err.message
    assert err.message.startswith("job 'job-t' group 'actor' step 1: ")


def test_coordinator_thread_stop_returns_when_the_loop_ends_before_running_it(
    coordinator_factory,
) -> None:
    """A stop() racing another (or a coordinator already stopped on its loop) must not
    wait for an answer from a loop that closes without running its request."""
    coord = coordinator_factory()
    loop = coord._loop
    assert loop is not None
    scheduled, release = threading.Event(), threading.Event()
    close, call_soon_threadsafe = loop.close, loop.call_soon_threadsafe

    def close_once_scheduled() -> None:
        release.wait()
        close()

    def schedule(*args, **kwargs):
        handle = call_soon_threadsafe(*args, **kwargs)
        scheduled.set()
        return handle

    loop.close = close_once_scheduled
    loop.call_soon_threadsafe = schedule
    # Stop the coordinator on its own loop: the thread's loop then ends and waits
    # in close() until the second stop() below has handed it its request.
    asyncio.run_coroutine_threadsafe(coord.coordinator.stop(0.0), loop).result()
    scheduled.clear()
    stopper = threading.Thread(target=coord.stop)
    stopper.start()
    scheduled.wait()
    release.set()
    stopper.join(timeout=60.0)
    assert not stopper.is_alive(), "CoordinatorThread.stop() hangs"
