"""Re-sends judged rank by rank: a node's ranks grouped otherwise when they retry
(a restarted agent, a passed node deadline) get the round's one answer; a rank
that changed its partials is named; an aggregate mixing counted and new ranks is
refused so they go alone. Live, and after a coordinator restart on its store."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossreduce.client.aggregation import node_requests
from lossreduce.contribution import Contribution, contribution_digest, own_digests
from lossreduce.errors import ConflictingContributionError, InvalidPartialError
from lossreduce.server import CoordinatorSettings, Outcome, RoundTable
from lossreduce.server.resends import ResendKind, judge_resend
from lossreduce.v2 import coordinator_pb2 as pb
from tests.server.test_round_table import KEY, MemoryStore, answer

TERMS, CONTRACTS = ("tok", "seq"), ("mean:tok", "mean:seq")
WORLD = 8


def single(rank: int, values: tuple[float, float], world: int = WORLD) -> Contribution:
    return Contribution(rank, world, TERMS, values, CONTRACTS, run="run-a")


def node(contributions: list[Contribution]) -> Contribution:
    """What a node agent sends for these ranks (an aggregate when there are several)."""
    key = pb.RoundKey(job=KEY.job, group=KEY.group, step=KEY.step)
    (request,) = node_requests(key, contributions)
    return Contribution.from_request(request)


def partials(rank: int) -> tuple[float, float]:
    return (float(100 + 7 * rank), 0.1 * (rank + 1))


def expected_sums() -> tuple[float, float]:
    return (
        math.fsum(partials(r)[0] for r in range(WORLD)),
        math.fsum(partials(r)[1] for r in range(WORLD)),
    )


def live_table() -> RoundTable:
    return RoundTable(CoordinatorSettings(round_timeout_s=10.0))


def test_an_aggregate_carries_each_covered_ranks_own_digest_over_the_wire() -> None:
    ranks = [single(r, partials(r)) for r in (2, 3, 5)]
    aggregate = node(ranks)
    assert aggregate.covers == (2, 3, 5)
    assert own_digests(aggregate) == {c.rank: contribution_digest(c) for c in ranks}
    assert own_digests(ranks[0]) == {2: contribution_digest(ranks[0])}


def test_a_restarted_agents_regrouped_retry_gets_the_rounds_answer() -> None:
    # The soak's case: the first agent sent ranks 4..7 as one aggregate and the round
    # completed; a restarted agent then hears only 4 and 5 again and, at its deadline,
    # sends them as an aggregate of their own.
    table = live_table()
    table.contribute(KEY, node([single(r, partials(r)) for r in range(4)]), 0.0)
    done = table.contribute(KEY, node([single(r, partials(r)) for r in range(4, 8)]), 0.0)
    outcome = answer(done, 4)
    assert isinstance(outcome, Outcome)
    assert tuple(n.value for n in outcome.normalizers) == expected_sums()
    for retry in (
        node([single(4, partials(4)), single(5, partials(5))]),  # a part of one aggregate
        single(6, partials(6)),  # one rank alone
        node([single(r, partials(r)) for r in range(2, 6)]),  # across two aggregates
    ):
        assert answer(table.contribute(KEY, retry, 1.0), retry.rank) is outcome, retry.ranks


def test_a_rank_that_changed_its_partials_is_named_whatever_its_grouping() -> None:
    table = live_table()
    table.contribute(KEY, node([single(r, partials(r)) for r in range(4)]), 0.0)
    changed = node([single(1, partials(1)), single(2, (1.0, 1.0))])
    err = answer(table.contribute(KEY, changed, 0.0), 1)
    assert isinstance(err, ConflictingContributionError)
    assert err.rank == 2
    assert err.ranks == (2,)
    assert "rank 2 already contributed other partials, counted in the aggregate of ranks" in (
        err.message
    )
    assert "[0, 1, 2, 3]" in err.message
    alone = answer(table.contribute(KEY, single(3, (9.0, 9.0)), 0.0), 3)
    assert isinstance(alone, ConflictingContributionError)
    assert alone.rank == 3
    assert "now sent 'tok'=9.0" in alone.message
    # The round is untouched: the other ranks still complete it with the first values.
    done = table.contribute(KEY, node([single(r, partials(r)) for r in range(4, 8)]), 0.0)
    outcome = answer(done, 7)
    assert isinstance(outcome, Outcome)
    assert tuple(n.value for n in outcome.normalizers) == expected_sums()


def test_an_aggregate_of_counted_and_new_ranks_is_refused_and_its_ranks_then_go_alone() -> None:
    table = live_table()
    # Before its deadline the node sent ranks 0..2; it then restarted and hears 0..3.
    table.contribute(KEY, node([single(r, partials(r)) for r in range(3)]), 0.0)
    mixed = node([single(r, partials(r)) for r in range(4)])
    err = answer(table.contribute(KEY, mixed, 0.0), 0)
    assert isinstance(err, ConflictingContributionError)
    assert err.ranks == (3,)
    assert "re-sends ranks [0, 1, 2], already counted, together with ranks [3]" in err.message
    for r in range(4):  # what the agent does next
        table.contribute(KEY, single(r, partials(r)), 0.0)
    done = table.contribute(KEY, node([single(r, partials(r)) for r in range(4, 8)]), 0.0)
    outcome = answer(done, 0)
    assert isinstance(outcome, Outcome)
    assert tuple(n.value for n in outcome.normalizers) == expected_sums()


def test_after_a_restart_resends_are_judged_per_rank_from_the_journal_record() -> None:
    ref: list[RoundTable] = []
    store = MemoryStore(ref)
    settings_ = CoordinatorSettings(round_timeout_s=10.0)
    ref.append(RoundTable(settings_, store=store))
    ref[0].contribute(KEY, node([single(r, partials(r)) for r in range(5)]), 0.0)
    ref[0].contribute(KEY, node([single(r, partials(r)) for r in range(5, 8)]), 0.0)
    stored = store.outcomes[KEY]
    restarted = RoundTable(settings_, store=store)
    for retry in (node([single(r, partials(r)) for r in (3, 4, 5)]), single(0, partials(0))):
        assert answer(restarted.contribute(KEY, retry, 0.0), retry.rank) is stored
    err = answer(restarted.contribute(KEY, single(6, (1.0, 2.0)), 0.0), 6)
    assert isinstance(err, ConflictingContributionError)
    assert "before the coordinator restarted" in err.message
    assert err.rank == 6


def test_an_aggregate_from_an_older_agent_without_digests_still_matches_as_a_whole() -> None:
    table = live_table()
    full = node([single(r, partials(r)) for r in range(4)])
    old = Contribution(
        full.rank, full.world_size, full.terms, full.values, full.contracts,
        full.covers, full.expansions, full.zero_ranks, full.run,
    )  # fmt: skip
    table.contribute(KEY, old, 0.0)
    assert answer(table.contribute(KEY, old, 0.0), 0) is None  # a retry, still waiting
    part = answer(table.contribute(KEY, single(1, partials(1)), 0.0), 1)
    assert isinstance(part, ConflictingContributionError)  # nothing per rank to check it by


@pytest.mark.parametrize("digests", [(b"x" * 8,), tuple(b"abc" for _ in range(4))])
def test_covered_digests_of_the_wrong_count_or_size_are_invalid(
    digests: tuple[bytes, ...],
) -> None:
    full = node([single(r, partials(r)) for r in range(4)])
    bad = Contribution(
        full.rank, full.world_size, full.terms, full.values, full.contracts,
        full.covers, full.expansions, full.zero_ranks, full.run, digests,
    )  # fmt: skip
    err = answer(live_table().contribute(KEY, bad, 0.0), 0)
    assert isinstance(err, InvalidPartialError)
    assert "covered_digests" in err.message


def _groups(rng: random.Random, ranks: list[int]) -> list[list[int]]:
    """``ranks`` cut into random runs of consecutive members (a node's grouping)."""
    groups: list[list[int]] = []
    for r in ranks:
        if groups and rng.random() < 0.6:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), changed=st.none() | st.integers(0, WORLD - 1))
def test_any_regrouping_of_retries_gets_the_one_answer_or_names_the_changed_rank(
    seed: int, changed: int | None
) -> None:
    rng = random.Random(seed)
    table = live_table()
    first = [r for r in range(WORLD) if rng.random() < 0.7]
    for group in _groups(rng, first):
        table.contribute(KEY, node([single(r, partials(r)) for r in group]), 0.0)
    # Every rank retries (or arrives for the first time), grouped afresh.
    retries = list(range(WORLD))
    for group in _groups(rng, retries):
        sent = [single(r, (1e9, 1.0) if r == changed else partials(r)) for r in group]
        c = node(sent)
        verdict = judge_resend(c, lambda r: _counted(table, r))
        admission = table.contribute(KEY, c, 0.0)
        if verdict.kind in (ResendKind.MIXED, ResendKind.CHANGED):
            assert isinstance(admission.error, ConflictingContributionError)
            if verdict.kind is ResendKind.CHANGED:
                assert verdict.rank == changed
                assert admission.error.rank == changed
            for s in sent:  # the agent's fallback on a conflict: each alone
                alone = table.contribute(KEY, s, 0.0)
                assert (alone.error is not None) == (s.rank == changed and changed in first)
        else:  # new ranks, or a retry of counted ones however grouped: no refusal
            assert admission.error is None, admission.error
    rnd = table.lookup(KEY)
    assert rnd is not None
    assert rnd.outcome is not None
    if changed is None or changed in first:
        # The changed rank's first partials count, never its changed ones.
        assert tuple(n.value for n in rnd.outcome.normalizers) == expected_sums()
    else:
        # A rank's first arrival is its contribution, whatever it is.
        assert rnd.outcome.normalizers[0].value == math.fsum(
            1e9 if r == changed else partials(r)[0] for r in range(WORLD)
        )


def _counted(table: RoundTable, rank: int) -> bytes | None:
    rnd = table.lookup(KEY)
    return None if rnd is None else rnd.counted_digest(rank)
