"""Hostile and malformed input: hypothesis throws arbitrary requests and raw bytes at a real server.

Every answer must be a documented status carrying lossreduce's rich details
(bytes that are not a request at all included: INVALID_ARGUMENT); the server
must keep serving; and once the round timeout has passed no round may be left
collecting.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossreduce.contribution import Contribution
from lossreduce.errors import LossReduceError
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.status_codec import ERROR_DOMAIN, from_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

ROUND_TIMEOUT_S = 0.3
DRAIN_BOUND_S = 30.0
"""How long the leftover rounds of the fuzzing may take to time out; only a leak reaches it."""
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1

# What a caller may see, and whether the coordinator itself must have explained it.
SERVER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# The call's own deadline: a valid contribution waits for its peers.
CLIENT_CODES = {grpc.StatusCode.DEADLINE_EXCEEDED}
REDUCE = "/lossreduce.v2.ReductionCoordinator/Reduce"
REDUCE_STREAM = "/lossreduce.v2.ReductionCoordinator/ReduceStream"


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, str]]:
    coordinator_settings = CoordinatorSettings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        round_timeout_s=ROUND_TIMEOUT_S,
        shutdown_grace_s=0.1,
        max_rounds_in_flight=8,
        max_groups_per_job=4,
        max_jobs=16,
        max_terms=8,
        max_world_size=1024,
        max_message_bytes=64 * 1024,
    )
    with CoordinatorThread(coordinator_settings) as coord:
        assert coord.metrics_url is not None
        yield coord.target, coord.metrics_url
        _assert_healthy_and_drained(coord.target, coord.metrics_url)


@pytest.fixture(scope="module")
def channel(target: tuple[str, str]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        target[0], options=[("grpc.max_send_message_length", 1 << 22)]
    ) as ch:
        yield ch


def _leftovers(address: str, metrics_url: str) -> tuple[list[pb.RoundKey], list[str]]:
    """Rounds still collecting, and ``/metrics`` lines of groups with rounds in flight."""
    with grpc.insecure_channel(address) as ch:
        listed = pb_grpc.ReductionCoordinatorStub(ch).ListRounds(pb.ListRoundsRequest(), timeout=5)
    collecting = [r.round for r in listed.rounds if r.state == pb.ROUND_STATE_COLLECTING]
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    in_flight = [
        line
        for line in text.splitlines()
        if line.startswith("lossreduce_rounds_in_flight{") and not line.endswith(" 0.0")
    ]
    return collecting, in_flight


def _assert_healthy_and_drained(address: str, metrics_url: str) -> None:
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Every round left collecting times out after ROUND_TIMEOUT_S; a leaked one never does.
    deadline = time.monotonic() + DRAIN_BOUND_S
    collecting, in_flight = _leftovers(address, metrics_url)
    while (collecting or in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
        collecting, in_flight = _leftovers(address, metrics_url)
    assert not collecting, f"rounds leaked: {collecting[:5]}"
    assert not in_flight, in_flight


def _check_error(err: grpc.RpcError) -> None:
    assert isinstance(err, grpc.Call)
    code = err.code()
    if code in CLIENT_CODES:
        return
    assert code in SERVER_CODES, f"undocumented status {code}: {err.details()}"
    status = rpc_status.from_call(err)
    assert status is not None, f"{code} without rich details: {err.details()}"
    assert status.details, "no ErrorInfo"
    decoded = from_status(status)
    assert isinstance(decoded, LossReduceError)
    assert decoded.code == code.value[0] or code is grpc.StatusCode.INVALID_ARGUMENT


# -- strategies ---------------------------------------------------------------------------

names = st.one_of(
    st.sampled_from(["job", "j", "actor", "critic"]),
    st.text(max_size=40),
    st.text(min_size=100, max_size=3000),
)
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 5e-324, 1.7976931348623157e308, -1.0]),
)
partials = st.builds(
    pb.TermPartial,
    term=st.one_of(st.sampled_from(["tokens", "groups", "kl"]), st.text(max_size=80)),
    value=values,
    contract=st.one_of(st.just("mean:token_mean"), st.text(max_size=300)),
)
requests = st.builds(
    pb.ReduceRequest,
    round=st.builds(
        pb.RoundKey,
        job=names,
        group=names,
        step=st.one_of(st.integers(0, 5), st.integers(0, U64)),
    ),
    rank=st.one_of(st.integers(0, 4), st.integers(0, U32)),
    world_size=st.one_of(st.integers(0, 4), st.integers(0, U32)),
    partials=st.lists(partials, max_size=12),
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(request=requests)
def test_fuzzed_reduce_gets_a_documented_answer(
    channel: grpc.Channel, request: pb.ReduceRequest
) -> None:
    stub = pb_grpc.ReductionCoordinatorStub(channel)
    try:
        response = stub.Reduce(request, timeout=0.05)
    except grpc.RpcError as err:
        _check_error(err)
        return
    assert not response.error.code
    assert [n.term for n in response.normalizers] == [p.term for p in request.partials]


@FUZZ
@given(batch=st.lists(requests, min_size=1, max_size=6))
def test_fuzzed_streams_answer_every_request_in_order(
    channel: grpc.Channel, batch: list[pb.ReduceRequest]
) -> None:
    stub = pb_grpc.ReductionCoordinatorStub(channel)
    responses: list[pb.ReduceResponse] = []
    ended: grpc.StatusCode | None = None
    try:
        responses.extend(stub.ReduceStream(iter(batch), timeout=0.1))
    except grpc.RpcError as err:
        ended = err.code()
    if ended is not None:
        # Only the call's deadline (a valid request waiting for peers) may end the stream.
        assert ended in CLIENT_CODES, f"stream ended with {ended}"
        return
    assert len(responses) == len(batch)
    for response in responses:
        if response.error.code:
            assert (
                grpc.StatusCode(
                    next(c for c in grpc.StatusCode if c.value[0] == response.error.code)
                )
                in SERVER_CODES
            )
            info = response.error.details
            assert info, "a failed round's response carries ErrorInfo"
            assert from_status(response.error).message


@FUZZ
@given(key=st.builds(pb.RoundKey, job=names, group=names, step=st.integers(0, U64)))
def test_fuzzed_lookups_never_fail(channel: grpc.Channel, key: pb.RoundKey) -> None:
    stub = pb_grpc.ReductionCoordinatorStub(channel)
    status = stub.GetRound(pb.GetRoundRequest(round=key), timeout=5)
    assert status.state in (
        pb.ROUND_STATE_UNKNOWN,
        pb.ROUND_STATE_COLLECTING,
        pb.ROUND_STATE_COMPLETED,
        pb.ROUND_STATE_FAILED,
    )
    stub.ListRounds(pb.ListRoundsRequest(job=key.job), timeout=5)


@FUZZ
@given(payload=st.binary(max_size=2048))
def test_random_bytes_never_crash_the_server(channel: grpc.Channel, payload: bytes) -> None:
    raw = channel.unary_unary(REDUCE)  # no serializers: the bytes go out as they are
    try:
        raw(payload, timeout=0.05)
    except grpc.RpcError as err:
        _check_error(err)
    stream = channel.stream_stream(REDUCE_STREAM)
    try:
        list(stream(iter([payload, payload[::-1]]), timeout=0.1))
    except grpc.RpcError as err:
        _check_error(err)


def test_undecodable_bytes_are_an_invalid_argument(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(REDUCE)(b"\x00", timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "1-byte message is not a valid request" in str(info.value.details())
    good = pb.ReduceRequest(
        round=pb.RoundKey(job="bytes", group="g", step=0),
        rank=0,
        world_size=1,
        partials=[pb.TermPartial(term="t", value=2.0)],
    ).SerializeToString()
    stream = channel.stream_stream(REDUCE_STREAM)
    call = stream(iter([good, b"\xff\xff"]), timeout=5)
    answered = []
    with pytest.raises(grpc.RpcError) as stream_info:
        answered.extend(call)
    assert len(answered) == 1  # the request before the garbage was answered
    assert stream_info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_undecodable_bytes_to_the_other_methods_are_an_invalid_argument(
    channel: grpc.Channel,
) -> None:
    for method in ("GetRound", "ListRounds"):
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(f"/lossreduce.v2.ReductionCoordinator/{method}")(
                b"\xff\xff", timeout=5
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, method
        assert f"{method}: a 2-byte message is not a valid request" in str(info.value.details())


def test_an_oversized_message_names_the_size_limit(channel: grpc.Channel) -> None:
    request = pb.ReduceRequest(
        round=pb.RoundKey(job="big", group="actor", step=0),
        rank=0,
        world_size=1,
        partials=[pb.TermPartial(term="t", value=1.0, contract="x" * 100_000)],
    )
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.ReductionCoordinatorStub(channel).Reduce(request, timeout=5)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # gRPC answers before any handler runs; its message states both sizes.
    assert "65536" in str(info.value.details())


def test_error_details_use_the_lossreduce_domain(channel: grpc.Channel) -> None:
    request = pb.ReduceRequest(
        round=pb.RoundKey(job="j", group="g", step=1),
        rank=0,
        world_size=1,
        partials=[pb.TermPartial(term="t", value=float("nan"))],
    )
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.ReductionCoordinatorStub(channel).Reduce(request, timeout=5)
    status = rpc_status.from_call(info.value)
    assert status is not None
    assert ERROR_DOMAIN.encode() in status.details[0].value


# -- every limit names itself -------------------------------------------------------------


def _limit_request(
    *,
    job: str = "limits",
    group: str = "actor",
    step: int = 0,
    world_size: int = 2,
    terms: int = 1,
    contract: str = "mean:token_mean",
) -> pb.ReduceRequest:
    names = tuple(f"t{i}" for i in range(terms))
    contribution = Contribution(0, world_size, names, (1.0,) * terms, (contract,) * terms)
    return contribution.request(pb.RoundKey(job=job, group=group, step=step))


@pytest.mark.parametrize(
    ("request_", "code", "limit", "quoted"),
    [
        (_limit_request(job="j" * 5000), "INVALID_ARGUMENT", "max_name_length", "5000 characters"),
        (_limit_request(job=""), "INVALID_ARGUMENT", "max_name_length", "job name '' is empty"),
        (_limit_request(group="a\nb"), "INVALID_ARGUMENT", "max_name_length", "non-printable"),
        (_limit_request(contract="c" * 300), "INVALID_ARGUMENT", "max_contract_length", "300"),
        (_limit_request(terms=9), "RESOURCE_EXHAUSTED", "max_terms", "terms 9"),
        (_limit_request(world_size=2000), "RESOURCE_EXHAUSTED", "max_world_size", "2000"),
    ],
    ids=["long-job", "empty-job", "control-group", "long-contract", "terms", "world-size"],
)
def test_each_request_limit_is_named(
    channel: grpc.Channel, request_: pb.ReduceRequest, code: str, limit: str, quoted: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.ReductionCoordinatorStub(channel).Reduce(request_, timeout=5)
    assert info.value.code() is grpc.StatusCode[code]
    err = from_status(rpc_status.from_call(info.value))
    assert err.limit == limit
    assert quoted in err.message
    assert len(err.message) < 400, "a hostile name is not echoed back in full"


def test_rounds_in_flight_and_groups_per_job_are_bounded(coordinator_factory) -> None:
    coord = coordinator_factory(max_rounds_in_flight=2, max_groups_per_job=2)
    with grpc.insecure_channel(coord.target) as ch:
        stub = pb_grpc.ReductionCoordinatorStub(ch)
        # Two steps collecting (world 2, one rank each): a third may not open.
        for step in (0, 1):
            with pytest.raises(grpc.RpcError) as waited:
                stub.Reduce(_limit_request(step=step), timeout=0.2)
            assert waited.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as info:
            stub.Reduce(_limit_request(step=2), timeout=5)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert from_status(rpc_status.from_call(info.value)).limit == "max_rounds_in_flight"
        with pytest.raises(grpc.RpcError):
            stub.Reduce(_limit_request(group="critic"), timeout=0.2)
        with pytest.raises(grpc.RpcError) as groups:
            stub.Reduce(_limit_request(group="eval"), timeout=5)
        assert groups.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert from_status(rpc_status.from_call(groups.value)).limit == "max_groups_per_job"
