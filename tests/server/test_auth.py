"""Bearer tokens and per-job scopes: the token file, the interceptor, a real server."""

from __future__ import annotations

import logging
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from pydantic import SecretStr

from lossreduce.client import ClientSettings
from lossreduce.client._transport import call_metadata
from lossreduce.contribution import Contribution
from lossreduce.errors import AuthenticationError, LossReduceError
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.server.auth import (
    BearerTokenInterceptor,
    TokenFileError,
    TokenRegistry,
    load_tokens,
)
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

ADMIN = secrets.token_urlsafe(24)
SCOPED = secrets.token_urlsafe(24)
WRONG = secrets.token_urlsafe(24)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client configured with ``token`` sends."""
    return call_metadata(ClientSettings(token=SecretStr(token)))


# -- the token file -----------------------------------------------------------------


def test_token_file_lines_grant_every_job_or_the_listed_ones() -> None:
    registry = TokenRegistry.parse(
        f"# comment\n\n{ADMIN}\n{SCOPED}  job-a, job-b   # trailing comment\n", "tokens.txt"
    )
    admin = registry.authenticate(ADMIN)
    scoped = registry.authenticate(SCOPED)
    assert admin is not None
    assert admin.jobs is None
    assert admin.allows("anything")
    assert scoped is not None
    assert scoped.jobs == frozenset({"job-a", "job-b"})
    assert scoped.allows("job-b")
    assert not scoped.allows("job-c")
    assert scoped.source == "tokens.txt line 4"
    assert registry.authenticate(WRONG) is None
    assert registry.authenticate("") is None
    assert ADMIN not in repr(registry)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("short-token", "16 to 512 characters"),
        ("x" * 600, "16 to 512 characters"),
        ("ünïcode-token-123456", "printable ASCII"),
        (f"{ADMIN}\n{ADMIN} job-a", "defined twice"),
        (f"{ADMIN} job-a,,job-b", "separated by commas"),
        ("# only comments\n\n", "no tokens defined"),
    ],
)
def test_malformed_token_files_are_refused_without_echoing_tokens(text: str, problem: str) -> None:
    with pytest.raises(TokenFileError, match=problem) as info:
        TokenRegistry.parse(text, "tokens.txt")
    assert ADMIN not in str(info.value)
    assert "short-token" not in str(info.value)


def test_tokens_come_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{ADMIN}\n")
    path.chmod(0o600)
    registry = load_tokens(path, f"{SCOPED} job-a")
    assert registry is not None
    assert len(registry) == 2
    grant = registry.authenticate(SCOPED)
    assert grant is not None
    assert grant.source == "LOSSREDUCE_TOKEN line 1"
    assert load_tokens(None, None) is None
    with pytest.raises(TokenFileError, match="missing"):
        load_tokens(tmp_path / "missing", None)


def test_a_world_readable_token_file_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{ADMIN}\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="lossreduce.server.auth"):
        load_tokens(path, None)
    assert "chmod 600" in caplog.text
    assert ADMIN not in caplog.text


# -- a real coordinator behind the interceptor --------------------------------------


@pytest.fixture(scope="module")
def secured() -> Iterator[CoordinatorThread]:
    registry = TokenRegistry.parse(f"{ADMIN}\n{SCOPED} job-a\n", "tokens.txt")
    settings = CoordinatorSettings(
        host="127.0.0.1", port=0, metrics_port=0, round_timeout_s=2.0, shutdown_grace_s=0.2
    )
    with CoordinatorThread(settings, interceptors=[BearerTokenInterceptor(registry)]) as coord:
        yield coord


@pytest.fixture(scope="module")
def stub(secured: CoordinatorThread) -> Iterator[pb_grpc.ReductionCoordinatorStub]:
    with grpc.insecure_channel(secured.target) as channel:
        yield pb_grpc.ReductionCoordinatorStub(channel)


def _request(job: str, step: int, value: float = 3.0) -> pb.ReduceRequest:
    contribution = Contribution(0, 1, ("tokens",), (value,), ("mean:token_mean",))
    return contribution.request(pb.RoundKey(job=job, group="actor", step=step))


def _get_round(stub: pb_grpc.ReductionCoordinatorStub, token: str, job: str, step: int) -> Any:
    return stub.GetRound(
        pb.GetRoundRequest(round=pb.RoundKey(job=job, group="actor", step=step)),
        metadata=bearer(token),
        timeout=5,
    )


def _refusal(err: grpc.RpcError) -> LossReduceError:
    assert isinstance(err, grpc.Call)
    status = rpc_status.from_call(err)
    assert status is not None, "refusals carry a rich status"
    return from_status(status)


def test_a_call_without_a_token_is_unauthenticated(stub: pb_grpc.ReductionCoordinatorStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Reduce(_request("job-a", 0), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    err = _refusal(info.value)
    assert isinstance(err, AuthenticationError)
    assert "authorization: Bearer <token>" in err.message


@pytest.mark.parametrize("header", [f"Bearer {WRONG}", f"Basic {ADMIN}", ADMIN])
def test_a_wrong_token_is_unauthenticated_and_never_echoed(
    stub: pb_grpc.ReductionCoordinatorStub, header: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG), pytest.raises(grpc.RpcError) as info:
        stub.Reduce(_request("job-a", 1), metadata=(("authorization", header),), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(_refusal(info.value), AuthenticationError)
    for secret in (WRONG, ADMIN):
        assert secret not in str(info.value.details())
        assert secret not in caplog.text


def test_the_right_token_reduces(stub: pb_grpc.ReductionCoordinatorStub) -> None:
    response = stub.Reduce(_request("job-b", 2, 7.0), metadata=bearer(ADMIN), timeout=5)
    assert [(n.term, n.value) for n in response.normalizers] == [("tokens", 7.0)]


def test_a_token_opens_a_stream_and_no_token_does_not(
    stub: pb_grpc.ReductionCoordinatorStub,
) -> None:
    responses = list(
        stub.ReduceStream(
            iter([_request("job-b", 3), _request("job-b", 4, 5.0)]),
            metadata=bearer(ADMIN),
            timeout=5,
        )
    )
    assert [r.normalizers[0].value for r in responses] == [3.0, 5.0]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ReduceStream(iter([_request("job-b", 5)]), timeout=5))
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_a_scoped_token_works_in_its_own_job(stub: pb_grpc.ReductionCoordinatorStub) -> None:
    response = stub.Reduce(_request("job-a", 10, 2.0), metadata=bearer(SCOPED), timeout=5)
    assert response.normalizers[0].value == 2.0
    assert _get_round(stub, SCOPED, "job-a", 10).state == pb.ROUND_STATE_COMPLETED


def test_a_scoped_token_cannot_write_or_read_another_job(
    stub: pb_grpc.ReductionCoordinatorStub,
) -> None:
    stub.Reduce(_request("job-b", 20, 4.0), metadata=bearer(ADMIN), timeout=5)
    calls = {
        "Reduce": lambda: stub.Reduce(_request("job-b", 21), metadata=bearer(SCOPED), timeout=5),
        "GetRound": lambda: _get_round(stub, SCOPED, "job-b", 20),
        "ListRounds": lambda: stub.ListRounds(
            pb.ListRoundsRequest(job="job-b"), metadata=bearer(SCOPED), timeout=5
        ),
        "Claim": lambda: stub.Claim(
            pb.ClaimRequest(round=pb.RoundKey(job="job-b", group="actor"), run="r"),
            metadata=bearer(SCOPED),
            timeout=5,
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED, name
        err = _refusal(info.value)
        assert isinstance(err, AuthenticationError), name
        assert "job 'job-b'" in err.message
        assert "tokens.txt line 2" in err.message
        assert SCOPED not in err.message
    # The refused Reduce opened no round in the other job.
    assert _get_round(stub, ADMIN, "job-b", 21).state == pb.ROUND_STATE_UNKNOWN


def test_listing_every_job_with_a_scoped_token_shows_only_its_jobs(
    stub: pb_grpc.ReductionCoordinatorStub,
) -> None:
    stub.Reduce(_request("job-a", 30), metadata=bearer(ADMIN), timeout=5)
    stub.Reduce(_request("job-b", 30), metadata=bearer(ADMIN), timeout=5)
    everything = stub.ListRounds(pb.ListRoundsRequest(), metadata=bearer(ADMIN), timeout=5)
    assert {r.round.job for r in everything.rounds} == {"job-a", "job-b"}
    own = stub.ListRounds(pb.ListRoundsRequest(), metadata=bearer(SCOPED), timeout=5)
    assert own.rounds
    assert {r.round.job for r in own.rounds} == {"job-a"}


def test_a_scoped_stream_ends_at_the_first_foreign_request(
    stub: pb_grpc.ReductionCoordinatorStub,
) -> None:
    call = stub.ReduceStream(
        iter([_request("job-a", 40, 1.5), _request("job-b", 40), _request("job-a", 41)]),
        metadata=bearer(SCOPED),
        timeout=5,
    )
    answered = []
    with pytest.raises(grpc.RpcError) as info:
        answered.extend(call)
    assert [r.normalizers[0].value for r in answered] == [1.5]
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "job 'job-b'" in str(info.value.details())
    for job, step in (("job-b", 40), ("job-a", 41)):
        assert _get_round(stub, ADMIN, job, step).state == pb.ROUND_STATE_UNKNOWN, (job, step)


def test_undecodable_bytes_on_a_scoped_stream_are_an_invalid_argument(
    secured: CoordinatorThread,
) -> None:
    good = _request("job-a", 42, 2.5).SerializeToString()
    with grpc.insecure_channel(secured.target) as channel:
        stream = channel.stream_stream("/lossreduce.v2.ReductionCoordinator/ReduceStream")
        call = stream(iter([good, b"\xff\xff"]), metadata=bearer(SCOPED), timeout=5)
        answered = []
        with pytest.raises(grpc.RpcError) as info:
            answered.extend(call)
    assert len(answered) == 1  # the request before the garbage was answered
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "2-byte message is not a valid request" in str(info.value.details())


def test_health_answers_without_a_token(secured: CoordinatorThread) -> None:
    with grpc.insecure_channel(secured.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_expose_no_token(
    secured: CoordinatorThread, stub: pb_grpc.ReductionCoordinatorStub
) -> None:
    stub.Reduce(_request("job-a", 50), metadata=bearer(SCOPED), timeout=5)
    for token in (WRONG, SCOPED):
        with pytest.raises(grpc.RpcError):
            stub.Reduce(_request("job-b", 50), metadata=bearer(token), timeout=5)
    assert secured.metrics_url is not None
    with urllib.request.urlopen(secured.metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    assert "lossreduce_contributions_total" in text
    for secret in (ADMIN, SCOPED, WRONG):
        assert secret not in text
    assert "authorization" not in text.lower()
