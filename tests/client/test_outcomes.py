"""Every row of the coordinator's outcome table, seen from the client side.

Each test runs once over ReduceStream and once over unary Reduce (the
``client_settings`` fixture) against a real coordinator on a free loopback
port, and checks the exception type, its attributes and its message.
"""

from __future__ import annotations

import asyncio
import functools
import math
import operator

import pytest
import torch

from lossreduce.client import (
    AsyncReductionClient,
    ConflictingContributionError,
    ContractMismatchError,
    EmptyNormalizerError,
    InvalidPartialError,
    LimitExceededError,
    RoundAbortedError,
    RoundResult,
    RoundTimeoutError,
    StaleRoundError,
)


def test_all_ranks_get_identical_exact_normalizers(reduce_round) -> None:
    # Left-to-right float addition loses the three 1.0s; the exact sum keeps them.
    # (Not sum(): from Python 3.12 on it compensates, and keeps them too.)
    pg = [1e16, 1.0, 1.0, 1.0]
    kl = [torch.tensor(3.0), torch.tensor(0.0), torch.tensor(5.0, dtype=torch.float64), 0]
    outcomes = reduce_round("ok", [{"pg": p, "kl": k} for p, k in zip(pg, kl, strict=True)], step=4)
    expected_pg = math.fsum(pg)
    assert expected_pg != functools.reduce(operator.add, pg)
    for outcome in outcomes:
        assert isinstance(outcome, RoundResult)
        assert outcome.step == 4
        assert list(outcome.normalizers) == ["pg", "kl"]
        assert outcome.normalizers["pg"] == expected_pg
        assert outcome.normalizers["kl"] == 8.0
        assert dict(outcome.zero_ranks) == {"pg": 0, "kl": 2}


def test_empty_normalizer_fails_every_rank_naming_the_term(
    reduce_round, assert_names_round
) -> None:
    outcomes = reduce_round("empty", [{"pg": 2.0, "kl": 0.0}, {"pg": 1.0, "kl": 0}], step=9)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, EmptyNormalizerError)
        assert_names_round(err, "empty", 9, rank)
        assert err.terms == ("kl",)
        assert err.values == (0.0,)
        assert "'kl'=0.0" in str(err)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_invalid_partial_names_the_culprit_to_everyone(
    reduce_round, assert_names_round, bad: float
) -> None:
    job = f"invalid-{bad}"
    outcomes = reduce_round(job, [{"pg": 1.0}, {"pg": bad}, {"pg": 2.0}], step=2)
    culprit = outcomes[1]
    assert isinstance(culprit, InvalidPartialError)
    assert_names_round(culprit, job, 2, 1)
    assert culprit.terms == ("pg",)
    assert repr(culprit.values[0]) == repr(bad)
    assert f"'pg'={bad!r}" in str(culprit)
    for rank in (0, 2):
        peer = outcomes[rank]
        assert type(peer) is RoundAbortedError
        assert_names_round(peer, job, 2, rank)
        assert peer.culprit_rank == 1
        assert "rank 1" in str(peer)
        assert f"'pg'={bad!r}" in str(peer)


def test_rank_outside_the_world_is_rejected_and_named_to_peers(
    reduce_round, assert_names_round
) -> None:
    outcomes = reduce_round("outside", [{"pg": 1.0}, {"pg": 1.0}], ranks=[0, 5], step=1)
    culprit, peer = outcomes[1], outcomes[0]
    assert isinstance(culprit, InvalidPartialError)
    assert_names_round(culprit, "outside", 1, 5)
    assert "world_size 2" in str(culprit)
    assert isinstance(peer, RoundAbortedError)
    assert peer.culprit_rank == 5
    assert_names_round(peer, "outside", 1, 0)


def test_malformed_term_name_is_rejected_by_the_coordinator(reduce_round) -> None:
    outcomes = reduce_round("names", [{"pg": 1.0}, {"bad name": 1.0}], step=1)
    assert isinstance(outcomes[1], InvalidPartialError)
    assert "bad name" in str(outcomes[1])
    assert isinstance(outcomes[0], RoundAbortedError)
    assert outcomes[0].culprit_rank == 1


# A long round timeout: a peer answered by RoundTimeoutError would show the
# unencodable rank was never sent; RoundAbortedError shows it was, at once.
@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 20.0}], indirect=True)
@pytest.mark.parametrize(
    ("job", "partials", "contracts", "local"),
    [
        ("not-a-number", {"pg": "many"}, None, "partial for term 'pg' is not a number"),
        ("tensor", {"pg": torch.tensor([1.0, 2.0])}, None, "0-d tensor, got shape [2]"),
        (
            "unknown-contract",
            {"pg": 1.0},
            {"pg": "mean:token_mean", "kl": "mean:token_mean"},
            "contracts name terms ['kl'] that have no partial",
        ),
    ],
)
def test_unencodable_request_is_still_sent_so_peers_abort_at_once(
    reduce_round,
    assert_names_round,
    *,
    job: str,
    partials: dict[str, object],
    contracts: dict[str, str] | None,
    local: str,
) -> None:
    outcomes = reduce_round(
        job,
        [{"pg": 1.0}, partials, {"pg": 2.0}],
        contracts=[{"pg": "mean:token_mean"}, contracts, {"pg": "mean:token_mean"}],
        step=6,
    )
    culprit = outcomes[1]
    assert type(culprit) is InvalidPartialError
    assert_names_round(culprit, job, 6, 1)
    assert local in str(culprit)
    assert "sent NaN for" in str(culprit)
    # Chained to the coordinator's own answer about the NaN it was sent.
    assert isinstance(culprit.__cause__, InvalidPartialError)
    for rank in (0, 2):
        peer = outcomes[rank]
        assert type(peer) is RoundAbortedError, peer
        assert_names_round(peer, job, 6, rank)
        assert peer.culprit_rank == 1


@pytest.mark.parametrize(
    ("job", "options", "both_values"),
    [
        ("world", {"world_sizes": [2, 3]}, ("world_size 2", "world_size 3")),
        (
            "terms",
            {"partials": [{"pg": 1.0}, {"kl": 1.0}]},
            ("['pg']", "['kl']"),
        ),
        (
            "contracts",
            {"contracts": [{"pg": "mean:token_mean"}, {"pg": "mean:seq_mean"}]},
            ("'mean:token_mean'", "'mean:seq_mean'"),
        ),
    ],
)
def test_disagreeing_ranks_get_contract_mismatch(
    reduce_round,
    assert_names_round,
    job: str,
    options: dict[str, object],
    both_values: tuple[str, str],
) -> None:
    options = dict(options)  # parametrize shares the dict between transports
    partials = options.pop("partials", [{"pg": 1.0}, {"pg": 1.0}])
    outcomes = reduce_round(job, partials, step=3, **options)
    # Whichever rank arrived second is the one named as disagreeing; every rank
    # of the round gets the same error.
    for rank, err in enumerate(outcomes):
        assert isinstance(err, ContractMismatchError)
        assert_names_round(err, job, 3, rank)
        assert set(err.ranks) == {0, 1}
        for value in both_values:
            assert value in str(err)


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 0.3}], indirect=True)
def test_missing_ranks_time_out_naming_every_one(reduce_round, assert_names_round) -> None:
    outcomes = reduce_round("late", [{"pg": 1.0}, {"pg": 1.0}], world_sizes=[4, 4], step=5)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, RoundTimeoutError)
        assert isinstance(err, RoundAbortedError)
        assert err.missing_ranks == (2, 3)
        assert_names_round(err, "late", 5, rank)
        assert "[2, 3]" in str(err)


def test_identical_resend_gets_the_same_answer_and_counts_once(reduce_round) -> None:
    # Rank 0 contributes twice at once (a retry racing the original), then again
    # after the round completed.
    first = reduce_round(
        "retry", [{"pg": 2.0}, {"pg": 2.0}, {"pg": 3.0}], ranks=[0, 0, 1], world_sizes=[2, 2, 2]
    )
    again = reduce_round("retry", [{"pg": 2.0}], world_sizes=[2])
    for outcome in [*first, *again]:
        assert isinstance(outcome, RoundResult)
        assert outcome.normalizers == {"pg": 5.0}


def test_different_resend_conflicts_and_leaves_the_round_alone(
    reduce_round, assert_names_round
) -> None:
    done = reduce_round("conflict", [{"pg": 2.0}, {"pg": 3.0}])
    assert all(isinstance(o, RoundResult) and o.normalizers == {"pg": 5.0} for o in done)
    (err,) = reduce_round("conflict", [{"pg": 7.0}], world_sizes=[2])
    assert isinstance(err, ConflictingContributionError)
    assert_names_round(err, "conflict", 1, 0)
    assert "'pg'=2.0" in str(err)
    assert "'pg'=7.0" in str(err)
    (same,) = reduce_round("conflict", [{"pg": 3.0}], ranks=[1], world_sizes=[2])
    assert isinstance(same, RoundResult)
    assert same.normalizers == {"pg": 5.0}


@pytest.mark.parametrize(
    "coordinator", [{"retained_steps": 2, "finished_cache_size": 2}], indirect=True
)
def test_stale_step_is_refused_naming_the_window(reduce_round, assert_names_round) -> None:
    (done,) = reduce_round("stale", [{"pg": 1.0}], step=10)
    assert isinstance(done, RoundResult)
    (err,) = reduce_round("stale", [{"pg": 1.0}], step=3)
    assert isinstance(err, StaleRoundError)
    assert_names_round(err, "stale", 3, 0)
    assert "retained_steps=2" in str(err)


@pytest.mark.parametrize(
    "coordinator", [{"max_rounds_in_flight": 1, "round_timeout_s": 0.5}], indirect=True
)
def test_too_many_rounds_in_flight_names_the_limit(
    coordinator, client_settings, assert_names_round
) -> None:
    async def two_steps_at_once() -> list[object]:
        async with AsyncReductionClient(
            coordinator.target,
            job="limit",
            group="actor",
            rank=0,
            world_size=2,
            settings=client_settings,
        ) as client:
            calls = [client.reduce(step, {"pg": 1.0}) for step in (1, 2)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    # Rank 1 never comes: the first step to arrive collects until the timeout,
    # the other is refused at once because only one round may collect.
    outcomes = asyncio.run(two_steps_at_once())
    limited = [o for o in outcomes if isinstance(o, LimitExceededError)]
    assert len(limited) == 1
    assert sum(isinstance(o, RoundTimeoutError) for o in outcomes) == 1
    err = limited[0]
    assert err.limit == "max_rounds_in_flight"
    assert "max_rounds_in_flight=1" in str(err)
    assert_names_round(err, "limit", err.step, 0)
