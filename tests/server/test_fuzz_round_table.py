"""A hypothesis state machine over the pure RoundTable: random contributions, retries,
conflicts, timeouts and sweeps in any order, with the table's promises checked after
every step.

Promises checked:

- a round that has ended never changes its outcome and is never collected again
  (a late or retrying rank gets that ending, or a stale refusal once it was evicted);
- no rank is counted twice: ``arrived`` equals the distinct ranks stored, each stored
  contribution is the first one that rank sent;
- a completed round's normalizers are ``math.fsum`` of the stored partials in rank order;
- the live-round count, the rounds in flight per group and the finished cache stay
  within their bounds.
"""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lossreduce.server import CoordinatorSettings
from lossreduce.server.outcomes import Outcome, OutcomeKind, RoundKey
from lossreduce.server.round_table import Contribution, RoundTable

LIMITS = CoordinatorSettings(
    round_timeout_s=10.0,
    max_rounds_in_flight=3,
    finished_cache_size=3,
    retained_steps=4,
    max_groups_per_job=2,
    max_jobs=2,
    max_world_size=4,
    max_terms=3,
)
TERMS = [("t",), ("t", "u"), ("u", "t"), ("x",)]
VALUES = [0.0, 1.0, 2.5, 1e-300, 1e300, math.nan, -1.0, math.inf]


class RoundTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = RoundTable(LIMITS)
        self.now = 0.0
        # The first outcome seen for a round: it must never change.
        self.endings: dict[RoundKey, Outcome] = {}
        # The first accepted contribution of each rank of each round.
        self.accepted: dict[RoundKey, dict[int, Contribution]] = {}

    @rule(
        job=st.sampled_from(["j", "k", "l"]),
        group=st.sampled_from(["actor", "critic", "eval"]),
        step=st.integers(0, 12),
        rank=st.integers(0, 4),
        world_size=st.integers(0, 4),
        terms=st.sampled_from(TERMS),
        values=st.lists(st.sampled_from(VALUES), min_size=2, max_size=2),
        contract=st.sampled_from(["c", "d"]),
    )
    def contribute(
        self,
        *,
        job: str,
        group: str,
        step: int,
        rank: int,
        world_size: int,
        terms: tuple[str, ...],
        values: list[float],
        contract: str,
    ) -> None:
        key = RoundKey(job, group, step)
        c = Contribution(
            rank=rank,
            world_size=world_size,
            terms=terms,
            values=tuple(values[: len(terms)]),
            contracts=(contract,) * len(terms),
        )
        before = self.table.lookup(key)
        was_arrived = before.contribution_of(rank) if before is not None else None
        admission = self.table.contribute(key, c, self.now)
        rnd = admission.round
        if key in self.endings:
            # An ended round is never collected again.
            assert rnd is None or rnd.outcome is not None, f"{key} reopened"
        if rnd is None:
            assert admission.error is not None
            return
        assert rnd.key == key
        stored = rnd.contribution_of(rank)
        if stored is not None and was_arrived is None and stored is c:
            self.accepted.setdefault(key, {})[rank] = c
        if rnd.outcome is not None:
            self.endings.setdefault(key, rnd.outcome)

    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        for rnd in self.table.expire(self.now):
            assert rnd.outcome is not None
            assert rnd.outcome.kind is OutcomeKind.ABORTED_TIMEOUT
            assert rnd.outcome.error is not None
            assert tuple(rnd.outcome.error.ranks) == tuple(rnd.missing_ranks())
            self.endings.setdefault(rnd.key, rnd.outcome)

    @rule()
    def sweep_without_time(self) -> None:
        assert self.table.expire(self.now) == []

    @invariant()
    def endings_never_change(self) -> None:
        for key, outcome in self.endings.items():
            rnd = self.table.lookup(key)
            if rnd is not None:  # it may have been evicted from the finished cache
                assert rnd.outcome is outcome, f"{key} changed its outcome"

    @invariant()
    def nobody_counted_twice(self) -> None:
        live = 0
        for rnd in self.table.rounds():
            present = [r for r in range(rnd.world_size) if rnd.contribution_of(r) is not None]
            if rnd.outcome is None:
                live += 1
                assert rnd.arrived == len(present) < rnd.world_size
            for r in present:
                first = self.accepted.get(rnd.key, {}).get(r)
                assert first is None or rnd.contribution_of(r) is first
            if rnd.outcome is not None and rnd.outcome.kind is OutcomeKind.COMPLETED:
                assert len(present) == rnd.world_size
                ref = rnd.contribution_of(0)
                assert ref is not None
                for n in rnd.outcome.normalizers:
                    column = []
                    for r in present:
                        c = rnd.contribution_of(r)
                        assert c is not None
                        column.append(dict(zip(c.terms, c.values, strict=True))[n.term])
                    assert n.value.hex() == math.fsum(column).hex()
                    assert n.zero_ranks == column.count(0.0)
        assert self.table.live_count == live

    @invariant()
    def bounded(self) -> None:
        per_group: dict[tuple[str, str], list[bool]] = {}
        for rnd in self.table.rounds():
            per_group.setdefault((rnd.key.job, rnd.key.group), []).append(rnd.outcome is None)
        assert len({job for job, _ in per_group}) <= LIMITS.max_jobs
        for flags in per_group.values():
            assert flags.count(True) <= LIMITS.max_rounds_in_flight
            assert flags.count(False) <= LIMITS.finished_cache_size


RoundTableMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestRoundTableStateMachine = RoundTableMachine.TestCase
