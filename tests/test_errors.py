"""The exception hierarchy (``lossreduce.errors``) and its one wire mapping
(``lossreduce.status_codec``)."""

from __future__ import annotations

import math
import pickle

import pytest
from google.rpc import code_pb2, status_pb2

from lossreduce import errors, status_codec
from lossreduce.errors import (
    EmptyNormalizerError,
    InconsistentNormalizerError,
    LossReduceError,
    ReductionInputError,
    RoundAbortedError,
    RoundTimeoutError,
)
from lossreduce.status_codec import from_status, to_status


@pytest.mark.parametrize(
    "err",
    [
        EmptyNormalizerError(
            "no tokens",
            job="j",
            group="actor",
            step=3,
            rank=1,
            terms=["pg", "kl"],
            values=[0.0, math.inf],
        ),
        RoundTimeoutError("missing", job="j", group="g", step=9, rank=0, ranks=[2, 3]),
        RoundAbortedError(
            "peer bad", job="j", group="g", step=1, rank=0, ranks=[5], terms=["pg"], values=[-1.0]
        ),
        errors.LimitExceededError(
            "too many", job="j", group="g", step=2, limit="max_rounds_in_flight"
        ),
        errors.RunConflictError(
            "held", holder="run-1", held_since=1.5e9, job="j", group="g", step=0, run="run-2"
        ),
    ],
)
def test_status_round_trip_keeps_type_and_context(err: LossReduceError) -> None:
    back = from_status(to_status(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    for field in ("job", "group", "step", "rank", "terms", "ranks", "limit", "run"):
        assert getattr(back, field) == getattr(err, field)
    if isinstance(err, errors.RunConflictError):
        assert isinstance(back, errors.RunConflictError)
        assert (back.holder, back.held_since) == (err.holder, err.held_since)
    assert [repr(v) for v in back.values] == [repr(v) for v in err.values]


def test_reasons_are_unique() -> None:
    classes = [
        c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, LossReduceError)
    ]
    reasons = [c.reason for c in classes if c.reason != "UNKNOWN"]
    assert len(reasons) == len(set(reasons))


def test_pickle_keeps_context() -> None:
    err = RoundTimeoutError("missing 2", job="j", group="g", step=4, rank=0, ranks=[2])
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, RoundTimeoutError)
    assert back.missing_ranks == (2,)
    assert back.step == 4
    assert str(back) == "missing 2"


def _tree() -> list[type[LossReduceError]]:
    return [
        c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, LossReduceError)
    ]


def test_the_tree_drawing_names_every_class_once() -> None:
    drawing = errors.__doc__ or ""
    for cls in _tree():
        assert drawing.count(f" {cls.__name__} ") == 1, cls.__name__


@pytest.mark.parametrize(
    "cls", [c for c in _tree() if c.reason != "UNKNOWN"], ids=lambda c: c.__name__
)
def test_every_concrete_class_decodes_to_itself_with_its_code(cls: type[LossReduceError]) -> None:
    err = cls("what went wrong", job="j", group="g", step=1, rank=0, terms=["t"], values=[0.5])
    status = to_status(err)
    assert status.code == cls.code
    assert status.details[0].TypeName() == "google.rpc.ErrorInfo"
    back = from_status(status)
    assert type(back) is cls
    assert (back.message, back.terms, back.values) == ("what went wrong", ("t",), (0.5,))


def test_a_status_without_details_decodes_by_code_with_the_callers_context() -> None:
    bare = status_pb2.Status(code=code_pb2.DEADLINE_EXCEEDED)
    err = from_status(bare, job="j", group="g", step=4, rank=2)
    assert isinstance(err, errors.CoordinatorUnavailableError)
    assert (err.message, err.job, err.step, err.rank) == ("DEADLINE_EXCEEDED", "j", 4, 2)
    foreign = status_pb2.Status(code=code_pb2.INTERNAL, message="boom")
    assert type(from_status(foreign)) is LossReduceError


def test_a_subclass_elsewhere_does_not_capture_its_parents_reason() -> None:
    class Local(errors.RoundAbortedError):
        pass

    err = errors.RoundAbortedError("peer", job="j", group="g", step=1, ranks=[3])
    assert type(from_status(to_status(err))) is errors.RoundAbortedError
    assert status_codec.ERROR_DOMAIN == "lossreduce.v2"
    assert Local.reason == "PEER_INVALID"


def test_inconsistent_normalizer_is_in_the_tree_and_still_a_value_error() -> None:
    err = InconsistentNormalizerError("step 0 term 'loss': local mean 1.5 * 3.0 != 3.0")
    assert isinstance(err, ReductionInputError)
    assert isinstance(err, LossReduceError)
    assert isinstance(err, ValueError)
    with pytest.raises(ValueError, match=r"local mean 1\.5"):
        raise err


def test_the_reduction_library_raises_the_tree_class() -> None:
    from lossreduce.trainer_worker import reduction

    assert reduction.InconsistentNormalizerError is InconsistentNormalizerError
    assert "InconsistentNormalizerError" in reduction.__all__
