"""The node agent against a real coordinator: ranks are unchanged clients pointed
at their node's agent; the agents send one aggregated contribution per round.

Every test runs the coordinator (its own thread), the agents and the ranks'
asyncio clients on real loopback ports, and waits for answers, never for time
to pass: round timeouts are long unless a test is about one.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import pytest

from lossreduce.client import AsyncReductionClient, ClientSettings, RoundResult
from lossreduce.client.agent import AgentSettings, NodeAgent
from lossreduce.errors import (
    ConflictingContributionError,
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    RoundAbortedError,
    RoundTimeoutError,
    RunConflictError,
)

JOB, GROUP = "agent", "actor"
TERMS = ("tokens", "groups")
CONTRACTS = {"tokens": "mean:token_mean", "groups": "mean:prompt_mean"}
HANG_GUARD_S = 60.0
"""Only so that a regression fails instead of hanging; never reached when correct."""
RANK_SETTINGS = ClientSettings(
    retry_budget_s=5.0, initial_backoff_s=0.02, max_backoff_s=0.2, call_timeout_s=30.0
)

T = TypeVar("T")
Outcome = RoundResult | LossReduceError
Rounds = dict[int, dict[int, Outcome]]


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(main(), HANG_GUARD_S)

    return asyncio.run(guarded())


def agent_settings(ranks: Sequence[int] | None, **overrides: Any) -> AgentSettings:
    return AgentSettings(
        local_ranks=None if ranks is None else tuple(ranks),
        retry_budget_s=5.0,
        initial_backoff_s=0.02,
        max_backoff_s=0.2,
        shutdown_grace_s=0.2,
        **overrides,
    )


async def start_agents(
    upstream: str, nodes: Sequence[Sequence[int] | None], **overrides: Any
) -> list[NodeAgent]:
    agents = [
        NodeAgent(upstream, job=JOB, settings=agent_settings(ranks, **overrides)) for ranks in nodes
    ]
    for agent in agents:
        await agent.start()
    return agents


async def stop_all(agents: Sequence[NodeAgent]) -> None:
    for agent in agents:
        await agent.stop()


async def reduce_ranks(
    targets: Mapping[int, str],
    values: Mapping[int, Sequence[float]],
    world: int,
    step: int,
    *,
    group: str = GROUP,
    settings: ClientSettings = RANK_SETTINGS,
) -> dict[int, Outcome]:
    """Rank ``r`` sends ``values[r]`` to ``targets[r]``, all at once in a shuffled
    order; each rank's result or error."""

    async def one(rank: int) -> Outcome:
        async with AsyncReductionClient(
            targets[rank], job=JOB, group=group, rank=rank, world_size=world, settings=settings
        ) as client:
            try:
                return await client.reduce_detailed(
                    step, dict(zip(TERMS, values[rank], strict=True)), CONTRACTS
                )
            except LossReduceError as err:
                return err

    order = list(targets)
    random.Random(step).shuffle(order)
    results = await asyncio.gather(*(one(r) for r in order))
    return dict(sorted(zip(order, results, strict=True)))


def sample(agent: NodeAgent, name: str, **labels: str) -> float:
    value = agent.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def random_values(world: int, seed: int) -> dict[int, list[float]]:
    rng = random.Random(seed)
    return {
        r: [rng.random() * 10 ** rng.randint(-8, 8), float(rng.randint(0, 3))] for r in range(world)
    }


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_rounds_through_agents_are_bit_identical_to_per_rank_rounds(coordinator):
    """Three nodes of 4, 3 and 1 ranks behind agents, the same partials sent by
    each rank straight to the coordinator: the same normalizers to the bit, and the
    same zero counts; each agent forwarded one contribution per round."""
    world, nodes = 8, [(0, 1, 2, 3), (4, 5, 6), (7,)]

    async def main() -> tuple[Rounds, Rounds, list[NodeAgent]]:
        agents = await start_agents(coordinator.target, nodes)
        try:
            targets = {r: a.target for a, ranks in zip(agents, nodes, strict=True) for r in ranks}
            through: Rounds = {}
            direct: Rounds = {}
            for step in range(3):
                values = random_values(world, step)
                through[step] = await reduce_ranks(targets, values, world, 2 * step)
                direct_targets = dict.fromkeys(range(world), coordinator.target)
                direct[step] = await reduce_ranks(direct_targets, values, world, 2 * step + 1)
            return through, direct, agents
        finally:
            await stop_all(agents)

    through, direct, agents = run(main)
    for step in range(3):
        values = random_values(world, step)
        expected = [math.fsum(values[r][i] for r in range(world)) for i in range(2)]
        for rank in range(world):
            agg, flat = through[step][rank], direct[step][rank]
            assert isinstance(agg, RoundResult), agg
            assert isinstance(flat, RoundResult), flat
            assert [agg.normalizers[t].hex() for t in TERMS] == [x.hex() for x in expected]
            assert [agg.normalizers[t].hex() for t in TERMS] == [
                flat.normalizers[t].hex() for t in TERMS
            ]
            assert agg.zero_ranks == flat.zero_ranks
    for agent in agents:
        assert sample(agent, "lossreduce_agent_rounds_forwarded_total", job=JOB, group=GROUP) == 3
        fallbacks = sample(
            agent, "lossreduce_agent_fallbacks_total", job=JOB, group=GROUP, reason="invalid"
        )
        assert fallbacks == 0


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_an_invalid_local_rank_falls_back_and_the_coordinator_names_it(coordinator):
    """Rank 2 sends a negative partial: its agent forwards every local rank's own
    contribution, so the coordinator answers rank 2 INVALID_ARGUMENT and every
    other rank, on every node, ABORTED naming rank 2 (as without agents)."""
    world, nodes = 4, [(0, 1, 2), (3,)]
    values = random_values(world, 1)
    values[2][0] = -1.0

    async def main() -> tuple[dict[int, Outcome], list[NodeAgent]]:
        agents = await start_agents(coordinator.target, nodes)
        try:
            targets = {r: a.target for a, ranks in zip(agents, nodes, strict=True) for r in ranks}
            return await reduce_ranks(targets, values, world, 1), agents
        finally:
            await stop_all(agents)

    results, agents = run(main)
    culprit = results[2]
    assert isinstance(culprit, InvalidPartialError), culprit
    assert (culprit.rank, culprit.step) == (2, 1)
    assert "rank 2" in str(culprit)
    assert "tokens" in str(culprit)
    for rank in (0, 1, 3):
        peer = results[rank]
        assert isinstance(peer, RoundAbortedError), peer
        assert peer.culprit_rank == 2
        assert peer.rank == rank
    labels = {"job": JOB, "group": GROUP, "reason": "invalid"}
    assert sample(agents[0], "lossreduce_agent_fallbacks_total", **labels) == 1
    assert sample(agents[1], "lossreduce_agent_fallbacks_total", **labels) == 0


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_a_rank_at_the_wrong_agent_is_named_and_its_peers_are_not_left_waiting(coordinator):
    """Rank 2 belongs to node B but dials node A's agent: it gets INVALID_ARGUMENT
    naming itself, agent A and A's ranks; the round is aborted at once for the ranks
    on A, and for rank 3 on B within B's node timeout (not the round timeout)."""
    world = 4

    async def main() -> tuple[dict[int, Outcome], list[NodeAgent]]:
        agents = await start_agents(coordinator.target, [(0, 1), (2, 3)], node_timeout_s=0.2)
        a, b = agents
        try:
            targets = {0: a.target, 1: a.target, 2: a.target, 3: b.target}
            return await reduce_ranks(targets, random_values(world, 2), world, 1), agents
        finally:
            await stop_all(agents)

    results, agents = run(main)
    stray = results[2]
    assert isinstance(stray, InvalidPartialError), stray
    assert stray.rank == 2
    message = str(stray)
    assert "rank 2 is not a local rank of node agent" in message
    assert agents[0].target in message
    assert "[0, 1]" in message
    for rank in (0, 1, 3):
        peer = results[rank]
        assert isinstance(peer, RoundAbortedError), peer
        assert peer.culprit_rank == 2
    labels = {"job": JOB, "group": GROUP, "reason": "wrong_node"}
    assert sample(agents[0], "lossreduce_agent_rejected_requests_total", **labels) == 1


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 0.5}], indirect=True)
def test_an_agent_rank_that_never_comes_is_named_by_the_coordinators_timeout(coordinator):
    """Agent A serves ranks 0 and 1; rank 1 never comes. Rank 0 (after A's node
    timeout) and node B's ranks get the coordinator's RoundTimeoutError naming rank 1."""
    world = 4

    async def main() -> dict[int, Outcome]:
        agents = await start_agents(coordinator.target, [(0, 1), (2, 3)], node_timeout_s=0.05)
        a, b = agents
        try:
            targets = {0: a.target, 2: b.target, 3: b.target}
            return await reduce_ranks(targets, random_values(world, 3), world, 1)
        finally:
            await stop_all(agents)

    results = run(main)
    for rank, err in results.items():
        assert isinstance(err, RoundTimeoutError), (rank, err)
        assert err.missing_ranks == (1,)
        assert err.rank == rank


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_an_agent_without_local_ranks_learns_them_from_its_first_round(coordinator):
    """``local_ranks=None``: the first round goes up rank by rank, then the agent
    aggregates; a rank outside what it learned is refused by name."""
    world = 3

    async def main() -> tuple[list[dict[int, Outcome]], dict[int, Outcome], NodeAgent]:
        (agent,) = await start_agents(coordinator.target, [None])
        try:
            targets = dict.fromkeys(range(world), agent.target)
            rounds = [
                await reduce_ranks(targets, random_values(world, s), world, s) for s in range(3)
            ]
            stray = await reduce_ranks({5: agent.target}, {5: [1.0, 1.0]}, 6, 9)
            return rounds, stray, agent
        finally:
            await agent.stop()

    rounds, stray, agent = run(main)
    for step, results in enumerate(rounds):
        values = random_values(world, step)
        expected = {t: math.fsum(values[r][i] for r in range(world)) for i, t in enumerate(TERMS)}
        assert all(
            isinstance(r, RoundResult) and dict(r.normalizers) == expected for r in results.values()
        ), results
    labels = {"job": JOB, "group": GROUP}
    assert sample(agent, "lossreduce_agent_fallbacks_total", reason="unknown_ranks", **labels) == 1
    assert sample(agent, "lossreduce_agent_rounds_forwarded_total", **labels) == 3
    assert sample(agent, "lossreduce_agent_local_ranks", **labels) == world
    assert isinstance(stray[5], InvalidPartialError), stray
    assert "(local ranks [0, 1, 2])" in str(stray[5])


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_a_retry_is_answered_alike_and_a_changed_contribution_conflicts(coordinator):
    """A rank re-sending its contribution gets the round's answer again; one sending
    another value for the same round gets ALREADY_EXISTS, and the round stands."""
    world = 2

    async def main() -> tuple[dict[int, Outcome], dict[int, Outcome], dict[int, Outcome]]:
        (agent,) = await start_agents(coordinator.target, [(0, 1)])
        try:
            targets = dict.fromkeys(range(world), agent.target)
            values = random_values(world, 4)
            first = await reduce_ranks(targets, values, world, 1)
            again = await reduce_ranks({0: agent.target}, values, world, 1)
            changed = await reduce_ranks({0: agent.target}, {0: [9.0, 9.0]}, world, 1)
            return first, again, changed
        finally:
            await agent.stop()

    first, again, changed = run(main)
    assert isinstance(first[0], RoundResult)
    assert again[0] == first[0]
    assert isinstance(changed[0], ConflictingContributionError), changed
    assert "rank 0" in str(changed[0])


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_an_error_reads_the_same_through_an_agent_as_from_the_coordinator(coordinator):
    """Every rank sends 0 for ``groups``: through agents and straight to the
    coordinator, each rank raises the same class with the same message."""
    world, nodes = 4, [(0, 1), (2, 3)]
    values = {r: [1.0, 0.0] for r in range(world)}

    async def main() -> tuple[dict[int, Outcome], dict[int, Outcome]]:
        agents = await start_agents(coordinator.target, nodes)
        try:
            targets = {r: a.target for a, ranks in zip(agents, nodes, strict=True) for r in ranks}
            through = await reduce_ranks(targets, values, world, 1)
        finally:
            await stop_all(agents)
        straight = dict.fromkeys(range(world), coordinator.target)
        direct = await reduce_ranks(straight, values, world, 1, group="direct")
        return through, direct

    through, direct = run(main)
    for rank in range(world):
        agg, flat = through[rank], direct[rank]
        assert isinstance(agg, EmptyNormalizerError), agg
        assert type(agg) is type(flat)
        assert str(agg) == str(flat).replace("group 'direct'", f"group {GROUP!r}")
        assert (agg.rank, agg.terms, agg.values) == (flat.rank, flat.terms, flat.values)


def test_a_claim_through_an_agent_reaches_the_coordinator(coordinator):
    """A rank pointed at its agent claims its group upstream: a second run is
    refused through the agent with the coordinator's own RunConflictError."""

    async def main() -> tuple[bool, LossReduceError | None]:
        (agent,) = await start_agents(coordinator.target, [(0, 1)])
        try:
            async with AsyncReductionClient(
                agent.target, job=JOB, group="claimed", rank=0, world_size=2, run="first"
            ) as first:
                took_over = await first.claim(0)
            async with AsyncReductionClient(
                coordinator.target, job=JOB, group="claimed", rank=1, world_size=2, run="second"
            ) as second:
                try:
                    await second.claim(0)
                except LossReduceError as err:
                    return took_over, err
            return took_over, None
        finally:
            await stop_all([agent])

    took_over, refused = run(main)
    assert took_over is False
    assert isinstance(refused, RunConflictError), refused
    assert (refused.holder, refused.run) == ("first", "second")
