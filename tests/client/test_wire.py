"""The pure conversions: partials to requests, responses and statuses to results/errors."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from google.rpc import code_pb2, status_pb2
from hypothesis import given
from hypothesis import strategies as st

from lossreduce import errors, status_codec
from lossreduce.client._wire import (
    RoundContext,
    build_request,
    closed_error,
    coerce_partial,
    deadline_error,
    decode_status,
    parse_response,
    unavailable_error,
)
from lossreduce.contribution import Contribution
from lossreduce.v2 import coordinator_pb2 as pb

CTX = RoundContext(job="job-a", group="actor", step=7, rank=2, world_size=4)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**53), 2**53))
def test_python_numbers_pass_through_unchanged(value: float) -> None:
    got = coerce_partial("pg", value, CTX)
    assert type(got) is float
    assert got == float(value) or (math.isnan(got) and math.isnan(value))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_zero_dim_tensors_are_read_with_item(dtype: torch.dtype) -> None:
    assert coerce_partial("pg", torch.tensor(12, dtype=dtype), CTX) == 12.0


def test_nan_tensor_is_kept_for_the_coordinator_to_reject() -> None:
    assert math.isnan(coerce_partial("pg", torch.tensor(float("nan")), CTX))


def test_numpy_scalars_are_accepted() -> None:
    assert coerce_partial("pg", np.float32(2.5), CTX) == 2.5
    assert coerce_partial("pg", np.int64(3), CTX) == 3.0


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (torch.tensor([1.0, 2.0]), r"0-d tensor, got shape \[2\]"),
        (torch.tensor([3.0]), r"0-d tensor, got shape \[1\]"),
        (True, "bool"),
        ("3", "str"),
        (None, "NoneType"),
        (torch.tensor(True), "not a number"),
    ],
)
def test_values_that_cannot_be_encoded_are_rejected_locally(value: object, why: str) -> None:
    with pytest.raises(errors.InvalidPartialError, match=why) as info:
        coerce_partial("kl", value, CTX)
    err = info.value
    assert (err.job, err.group, err.step, err.rank, err.terms) == ("job-a", "actor", 7, 2, ("kl",))
    assert "job 'job-a' group 'actor' step 7 rank 2" in str(err)
    assert "'kl'" in str(err)


def test_request_keeps_term_order_contracts_and_identity() -> None:
    outgoing = build_request(
        CTX,
        {"pg": torch.tensor(5.0), "kl": 3, "ent": 0.0},
        {"pg": "mean:prompt_mean", "kl": "mean:token_mean"},
    )
    assert outgoing.local_error is None
    request = outgoing.request
    assert request.round == pb.RoundKey(job="job-a", group="actor", step=7)
    assert (request.rank, request.world_size) == (2, 4)
    assert [(p.term, p.value, p.contract) for p in request.partials] == [
        ("pg", 5.0, "mean:prompt_mean"),
        ("kl", 3.0, "mean:token_mean"),
        ("ent", 0.0, ""),
    ]
    assert request == Contribution.from_request(request).request(CTX.key)


def test_contract_for_an_unknown_term_is_sent_as_nan_and_named() -> None:
    # Sent anyway, so the coordinator aborts the round for the peers at once.
    outgoing = build_request(CTX, {"pg": 1.0}, {"kl": "mean:token_mean"})
    sent = [(p.term, p.value, p.contract) for p in outgoing.request.partials]
    assert sent[0] == ("pg", 1.0, "")
    assert sent[1][0::2] == ("kl", "mean:token_mean")
    assert math.isnan(sent[1][1])
    err = outgoing.local_error
    assert isinstance(err, errors.InvalidPartialError)
    assert err.terms == ("kl",)
    assert (err.job, err.group, err.step, err.rank) == ("job-a", "actor", 7, 2)
    assert str(err) == (
        "job 'job-a' group 'actor' step 7 rank 2: contracts name terms ['kl'] that have no "
        "partial (terms: ['pg']); sent NaN for ['kl'] instead, so the coordinator aborts the "
        "round for every rank"
    )


def test_value_that_is_not_a_number_is_sent_as_nan_and_named() -> None:
    partials: dict[str, object] = {"pg": 1.0, "kl": "many", "ent": torch.tensor([1.0, 2.0])}
    outgoing = build_request(CTX, partials)  # type: ignore[arg-type]
    values = {p.term: p.value for p in outgoing.request.partials}
    assert values["pg"] == 1.0
    assert math.isnan(values["kl"])
    assert math.isnan(values["ent"])
    err = outgoing.local_error
    assert isinstance(err, errors.InvalidPartialError)
    assert err.terms == ("kl", "ent")
    assert "partial for term 'kl' is not a number (got str)" in str(err)
    assert "partial for term 'ent' is not a number (a partial must be a 0-d tensor" in str(err)


def _response(step: int = 7, **values: float) -> pb.ReduceResponse:
    return pb.ReduceResponse(
        round=pb.RoundKey(job="job-a", group="actor", step=step),
        normalizers=[
            pb.TermNormalizer(term=t, value=v, zero_ranks=i)
            for i, (t, v) in enumerate(values.items())
        ],
    )


def test_response_becomes_a_result_in_term_order() -> None:
    result = parse_response(_response(pg=10.0, kl=4.0), CTX)
    assert list(result.normalizers.items()) == [("pg", 10.0), ("kl", 4.0)]
    assert dict(result.zero_ranks) == {"pg": 0, "kl": 1}
    assert result.step == 7


def test_response_for_another_round_is_refused() -> None:
    with pytest.raises(
        errors.LossReduceError, match="answered for job 'job-a' group 'actor' step 8"
    ):
        parse_response(_response(step=8, pg=1.0), CTX)


def test_non_finite_normalizer_in_a_response_is_refused() -> None:
    with pytest.raises(errors.LossReduceError, match="non-finite") as info:
        parse_response(_response(pg=math.inf), CTX)
    assert info.value.terms == ("pg",)


def test_round_error_gets_the_receiving_rank() -> None:
    # Built like the coordinator does: once per round, no receiving rank.
    sent = errors.RoundAbortedError(
        "job 'job-a' group 'actor' step 7: rank 3 sent an invalid partial 'pg'=nan",
        job="job-a",
        group="actor",
        step=7,
        ranks=[3],
        terms=["pg"],
        values=[math.nan],
    )
    err = decode_status(status_codec.to_status(sent), CTX)
    assert type(err) is errors.RoundAbortedError
    assert isinstance(err, errors.RoundAbortedError)
    assert err.rank == 2
    assert err.culprit_rank == 3
    assert err.terms == ("pg",)
    assert math.isnan(err.values[0])
    assert str(err) == (
        "job 'job-a' group 'actor' step 7: rank 3 sent an invalid partial 'pg'=nan "
        "(reported to rank 2 of 4)"
    )


def test_error_naming_its_rank_is_kept_verbatim() -> None:
    sent = errors.InvalidPartialError(
        "job 'job-a' group 'actor' step 7: rank 2 sent 'pg'=-1.0",
        job="job-a",
        group="actor",
        step=7,
        rank=2,
        terms=["pg"],
        values=[-1.0],
    )
    err = decode_status(status_codec.to_status(sent), CTX)
    assert type(err) is errors.InvalidPartialError
    assert str(err) == str(sent)
    assert (err.rank, err.terms, err.values) == (2, ("pg",), (-1.0,))


def test_timeout_error_keeps_missing_ranks() -> None:
    sent = errors.RoundTimeoutError(
        "job 'job-a' group 'actor' step 7: ranks 1, 3 missing",
        job="job-a",
        group="actor",
        step=7,
        ranks=[1, 3],
    )
    err = decode_status(status_codec.to_status(sent), CTX)
    assert isinstance(err, errors.RoundTimeoutError)
    assert err.missing_ranks == (1, 3)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (code_pb2.RESOURCE_EXHAUSTED, errors.LimitExceededError),
        (code_pb2.UNAUTHENTICATED, errors.AuthenticationError),
        (code_pb2.PERMISSION_DENIED, errors.AuthenticationError),
        (code_pb2.INTERNAL, errors.LossReduceError),
    ],
)
def test_bare_grpc_status_is_mapped_by_code_and_given_full_context(
    code: int, cls: type[errors.LossReduceError]
) -> None:
    err = decode_status(
        status_pb2.Status(code=code, message="Received message larger than max"), CTX
    )
    assert type(err) is cls
    assert (err.job, err.group, err.step, err.rank) == ("job-a", "actor", 7, 2)
    assert str(err) == (
        "job 'job-a' group 'actor' step 7: Received message larger than max (reported to rank 2 of 4)"
    )


def test_unavailable_error_names_target_round_rank_and_attempts() -> None:
    last = status_pb2.Status(
        code=code_pb2.UNAVAILABLE, message="failed to connect to all addresses"
    )
    err = unavailable_error(CTX, "127.0.0.1:1234", attempts=5, elapsed_s=2.04, last=last)
    assert isinstance(err, errors.CoordinatorUnavailableError)
    assert str(err) == (
        "job 'job-a' group 'actor' step 7 rank 2: the coordinator at 127.0.0.1:1234 is "
        "unavailable; gave up after 5 attempts over 2.0 s "
        "(last error: UNAVAILABLE: failed to connect to all addresses)"
    )
    assert (err.job, err.step, err.rank) == ("job-a", 7, 2)


def test_deadline_error_names_the_setting() -> None:
    err = deadline_error(CTX, "127.0.0.1:1234", 2.5)
    assert isinstance(err, errors.CoordinatorUnavailableError)
    assert "within the call timeout of 2.5 s (ClientSettings.call_timeout_s)" in str(err)
    assert str(err).startswith("job 'job-a' group 'actor' step 7 rank 2:")


def test_closed_error_sentences() -> None:
    err = closed_error("j", "g", 1, 3, while_waiting=False)
    assert str(err) == "Cannot reduce step 3: the client for job 'j' rank 1 has been closed."
    assert (err.job, err.group, err.step, err.rank) == ("j", "g", 3, 1)
    waiting = closed_error("j", "g", 1, 3, while_waiting=True)
    assert str(waiting) == (
        "Step 3 was abandoned: the client for job 'j' rank 1 was closed while waiting for the round."
    )
    assert str(closed_error("j", "g", 1, None, while_waiting=False)) == (
        "Cannot open the client for job 'j' rank 1: it has been closed."
    )


def test_importing_the_client_does_not_import_torch() -> None:
    # A coordinator-side tool or a CPU-only driver can use the client without
    # paying for torch; tensors are read through .item() only.
    probe = "import sys, lossreduce.client; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "False"
