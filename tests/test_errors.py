"""The exception hierarchy and its one wire mapping."""

from __future__ import annotations

import math
import pickle

import pytest

from lossreduce import errors
from lossreduce.errors import (
    EmptyNormalizerError,
    LossReduceError,
    RoundAbortedError,
    RoundTimeoutError,
    from_status,
    to_status,
)


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
    ],
)
def test_status_round_trip_keeps_type_and_context(err: LossReduceError) -> None:
    back = from_status(to_status(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    for field in ("job", "group", "step", "rank", "terms", "ranks", "limit"):
        assert getattr(back, field) == getattr(err, field)
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
