"""The node aggregator's deadline and its upstream stream: every rank of a round
gets the coordinator's answer, whatever the node's local deadline says.

The node's ``node_timeout_s`` only bounds how long it waits for its own
stragglers before it hands the coordinator what it has; once a round is
upstream, only the coordinator's answer (or the loss of the stream) decides
it. The first tests run nodes against a real coordinator whose round timeout
is far longer than the nodes' (or, for the straggler that never comes,
short), and wait for what the coordinator has received rather than for time
to pass; the rest drive the aggregator over a scripted in-memory stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import pytest

from lossreduce.client import upstream
from lossreduce.client.aggregator import AggregatorSettings, NodeAggregator
from lossreduce.errors import CoordinatorUnavailableError, RoundTimeoutError
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

CONTRACT = {"n": "mean:token_mean"}
NODE_TIMEOUT_S = 0.05
"""The nodes' local deadline: far below the coordinator's round timeout."""
HANG_GUARD_S = 60.0
"""Only so that a regression fails instead of hanging; never reached when correct."""

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(main(), HANG_GUARD_S)

    return asyncio.run(guarded())


async def two_nodes(
    target: str, body: Callable[[NodeAggregator, NodeAggregator], Awaitable[T]]
) -> T:
    """Node A holds ranks 0 and 1, node B ranks 2 and 3, of a world of 4."""
    settings = AggregatorSettings(node_timeout_s=NODE_TIMEOUT_S)
    nodes = [
        NodeAggregator(
            target, job="deadline", group="actor", local_ranks=r, world_size=4, settings=settings
        )
        for r in [(0, 1), (2, 3)]
    ]
    try:
        for node in nodes:
            await node.open()
        return await body(nodes[0], nodes[1])
    finally:
        for node in nodes:
            await node.close()


def contribute(node: NodeAggregator, rank: int, step: int = 1) -> asyncio.Task[dict[str, float]]:
    return asyncio.create_task(node.local_rank(rank).reduce(step, {"n": 1.0}, CONTRACT))


async def coordinator_has(target: str, ranks: Sequence[int], step: int = 1) -> None:
    """Return once the coordinator's round ``step`` has every one of ``ranks``
    (bounded by ``run``'s guard)."""
    key = pb.RoundKey(job="deadline", group="actor", step=step)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        while True:
            status = await stub.GetRound(pb.GetRoundRequest(round=key), timeout=5)
            if set(ranks) <= set(status.arrived_ranks):
                return
            await asyncio.sleep(0.01)


async def past_node_deadline() -> None:
    """Return after every node timer scheduled before this call has fired: the loop
    runs timers in deadline order, and this one's deadline is later."""
    await asyncio.sleep(2 * NODE_TIMEOUT_S)


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_a_round_sent_upstream_is_decided_by_the_coordinator_not_the_node_deadline(coordinator):
    """Node A sends its round; its deadline passes; node B completes the round."""

    async def body(a: NodeAggregator, b: NodeAggregator) -> list[Any]:
        first = [contribute(a, 0), contribute(a, 1)]
        await coordinator_has(coordinator.target, (0, 1))
        await past_node_deadline()
        rest = [contribute(b, 2), contribute(b, 3)]
        return await asyncio.gather(*first, *rest, return_exceptions=True)

    results = run(lambda: two_nodes(coordinator.target, body))
    assert results == [{"n": 4.0}] * 4, results


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_a_local_straggler_after_the_node_deadline_still_joins_the_round(coordinator):
    """Rank 0 waits past node A's deadline for rank 1; the round still completes
    for every rank (node A hands rank 0 upstream, then rank 1 when it comes)."""

    async def body(a: NodeAggregator, b: NodeAggregator) -> list[Any]:
        early = contribute(a, 0)
        # Only node A's deadline sends rank 0 alone: rank 1 has not arrived.
        await coordinator_has(coordinator.target, (0,))
        rest = [contribute(b, 2), contribute(b, 3)]
        await coordinator_has(coordinator.target, (0, 2, 3))
        late = contribute(a, 1)
        return await asyncio.gather(early, late, *rest, return_exceptions=True)

    results = run(lambda: two_nodes(coordinator.target, body))
    assert results == [{"n": 4.0}] * 4, results


def restarted(target: str, local_ranks: tuple[int, ...]) -> NodeAggregator:
    """A fresh aggregator for a node whose agent restarted (it remembers nothing)."""
    settings = AggregatorSettings(node_timeout_s=NODE_TIMEOUT_S)
    return NodeAggregator(
        target, job="deadline", group="actor", local_ranks=local_ranks, world_size=4,
        settings=settings,
    )  # fmt: skip


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_after_an_agent_restart_retries_grouped_otherwise_get_the_rounds_answer(coordinator):
    """Node A's aggregate of ranks 0 and 1 was counted and the round completed; its
    agent restarts and only rank 0 retries: at the new agent's deadline it goes up
    alone (a part of the counted aggregate) and gets the round's answer."""

    async def body(a: NodeAggregator, b: NodeAggregator) -> list[Any]:
        first = await asyncio.gather(contribute(a, 0), contribute(a, 1), contribute(b, 2),
                                     contribute(b, 3))  # fmt: skip
        again = restarted(coordinator.target, (0, 1))
        try:
            retry = await contribute(again, 0)
        finally:
            await again.close()
        return [*first, retry]

    results = run(lambda: two_nodes(coordinator.target, body))
    assert results == [{"n": 4.0}] * 5, results


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_after_an_agent_restart_counted_and_new_ranks_go_up_alone(coordinator):
    """Node A sent rank 0 at its deadline (rank 1 late), then its agent restarted; the
    new agent aggregates the retrying rank 0 with rank 1's first arrival. The
    coordinator refuses that mix, the agent sends each alone, and the round completes
    for every rank with each rank counted once."""

    async def body(a: NodeAggregator, b: NodeAggregator) -> list[Any]:
        early = contribute(a, 0)
        await coordinator_has(coordinator.target, (0,))
        rest = [contribute(b, 2), contribute(b, 3)]
        await coordinator_has(coordinator.target, (0, 2, 3))
        early.cancel()  # the old agent died with rank 0's answer
        again = restarted(coordinator.target, (0, 1))
        try:
            regrouped = [contribute(again, 0), contribute(again, 1)]
            return await asyncio.gather(*regrouped, *rest, return_exceptions=True)
        finally:
            await again.close()

    results = run(lambda: two_nodes(coordinator.target, body))
    assert results == [{"n": 4.0}] * 4, results


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 0.5}], indirect=True)
def test_a_local_rank_that_never_comes_gets_every_rank_the_coordinators_timeout(coordinator):
    """Rank 1 never arrives: node A's rank 0 gets the same RoundTimeoutError,
    naming rank 1 only, as node B's ranks (not a node-local error of its own)."""

    async def body(a: NodeAggregator, b: NodeAggregator) -> list[Any]:
        tasks = [contribute(a, 0), contribute(b, 2), contribute(b, 3)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(lambda: two_nodes(coordinator.target, body))
    assert all(isinstance(r, RoundTimeoutError) for r in results), results
    assert [r.missing_ranks for r in results] == [(1,)] * 3
    # The coordinator's one message, decoded as the client decodes it for each rank.
    assert len({str(r).rsplit(" (reported to rank", 1)[0] for r in results}) == 1, results
    assert [
        str(r).endswith(f"(reported to rank {rank} of 4)")
        for r, rank in zip(results, (0, 2, 3), strict=True)
    ] == [True] * 3
    assert "job 'deadline' group 'actor' step 1" in str(results[0])


# --- over a scripted stream --------------------------------------------------------------


class ScriptedCall:
    """A ``ReduceStream`` call whose answers the test hands out."""

    def __init__(self) -> None:
        self.written: list[pb.ReduceRequest] = []
        self.answers: asyncio.Queue[pb.ReduceResponse | BaseException | None] = asyncio.Queue()
        self.answered = 0
        self.delivered = 0
        """Items ``read`` has handed the node's reader."""
        self.changed = asyncio.Condition()

    async def write(self, request: pb.ReduceRequest) -> None:
        self.written.append(request)
        async with self.changed:
            self.changed.notify_all()

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        return True

    async def read(self) -> Any:
        item = await self.answers.get()
        self.delivered += 1
        async with self.changed:
            self.changed.notify_all()
        if item is None:
            return grpc.aio.EOF
        if isinstance(item, BaseException):
            raise item
        return item

    async def until(self, *, written: int = 0, delivered: int = 0) -> None:
        """Return once at least ``written`` requests went out and ``delivered`` items
        were read. The reader handles an item before this wakes: it runs on from
        ``read`` to its next await in the same step."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: len(self.written) >= written and self.delivered >= delivered
            )

    def answer_ok(self, count: int) -> None:
        """Answer the next ``count`` unanswered requests with their own sums."""
        for request in self.written[self.answered : self.answered + count]:
            self.answered += 1
            self.answers.put_nowait(
                pb.ReduceResponse(
                    round=request.round,
                    normalizers=[
                        pb.TermNormalizer(term=p.term, value=p.value) for p in request.partials
                    ],
                )
            )


class ScriptedChannel:
    """Just enough of a ``grpc.aio.Channel`` for the generated stub and the node: each
    ``ReduceStream`` call is a new :class:`ScriptedCall`."""

    def __init__(self) -> None:
        self.calls: list[ScriptedCall] = []
        self.opened = asyncio.Event()

    def stream_stream(self, *args: object, **kwargs: object) -> Callable[..., ScriptedCall]:
        def open_call(*call_args: object, **call_kwargs: object) -> ScriptedCall:
            self.calls.append(ScriptedCall())
            self.opened.set()
            return self.calls[-1]

        return open_call

    def unary_unary(self, *args: object, **kwargs: object) -> Callable[..., Awaitable[Any]]:
        """A unary ``Reduce`` that finds the coordinator unavailable: the node backs off
        and opens a new stream."""

        async def unavailable(*call_args: object, **call_kwargs: object) -> Any:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )

        return unavailable

    async def close(self) -> None:
        pass

    async def call(self, index: int) -> ScriptedCall:
        """The ``index``-th stream the node opened, once it has."""
        while len(self.calls) <= index:
            self.opened.clear()
            await self.opened.wait()
        return self.calls[index]


ScriptedNode = Callable[..., Awaitable[tuple[NodeAggregator, ScriptedChannel]]]


@pytest.fixture
def scripted_node(monkeypatch: pytest.MonkeyPatch) -> ScriptedNode:
    """Makes a node of ranks 0 and 1 (world 2) whose channel is a scripted one."""

    async def make(
        timeout_s: float = 3600.0, retry_budget_s: float = 60.0
    ) -> tuple[NodeAggregator, ScriptedChannel]:
        channel = ScriptedChannel()
        monkeypatch.setattr(upstream, "open_channel", lambda target, settings: channel)
        node = NodeAggregator(
            "scripted",
            job="j",
            group="g",
            local_ranks=(0, 1),
            world_size=2,
            settings=AggregatorSettings(
                node_timeout_s=timeout_s,
                retry_budget_s=retry_budget_s,
                initial_backoff_s=0.001,
                max_backoff_s=0.01,
            ),
        )
        await node.open()
        return node, channel

    return make


def reduce(
    node: NodeAggregator, rank: int, step: int, value: float
) -> asyncio.Task[dict[str, float]]:
    return asyncio.create_task(node.local_rank(rank).reduce(step, {"n": value}, CONTRACT))


def both(node: NodeAggregator, step: int) -> list[asyncio.Task[dict[str, float]]]:
    return [reduce(node, r, step, float(step + 1)) for r in (0, 1)]


def steps_written(call: ScriptedCall) -> Sequence[int]:
    return [r.round.step for r in call.written]


def test_a_late_old_step_in_flight_survives_newer_steps_completing(scripted_node):
    """Steps 1..9 go upstream, then step 0 (its ranks came last); their answers
    come back in that order. Step 9's completion must not drop step 0."""

    async def main() -> list[Any]:
        node, channel = await scripted_node()
        tasks = {step: both(node, step) for step in range(1, 10)}
        call = await channel.call(0)
        await call.until(written=9)
        tasks[0] = both(node, 0)
        await call.until(written=10)
        assert steps_written(call) == [*range(1, 10), 0]
        call.answer_ok(10)
        results = await asyncio.gather(*(t for ts in tasks.values() for t in ts))
        # The stream still reads answers after that.
        tasks[10] = both(node, 10)
        await call.until(written=11)
        call.answer_ok(1)
        results += await asyncio.gather(*tasks[10])
        await node.close()
        assert len(channel.calls) == 1
        return results

    results = run(main)
    expected = [{"n": 2.0 * (s + 1)} for s in [*range(1, 10), 0, 10] for _ in range(2)]
    assert results == expected


def test_a_step_still_collecting_survives_newer_steps_completing(scripted_node):
    """Rank 0 of step 0 arrives, steps 1..9 complete, then rank 1 of step 0."""

    async def main() -> list[Any]:
        node, channel = await scripted_node()
        early = reduce(node, 0, 0, 1.0)
        for step in range(1, 10):
            tasks = both(node, step)
            call = await channel.call(0)
            await call.until(written=step)
            call.answer_ok(1)
            await asyncio.gather(*tasks)
        late = reduce(node, 1, 0, 1.0)
        await call.until(written=10)
        assert steps_written(call) == [*range(1, 10), 0]
        call.answer_ok(1)
        results = list(await asyncio.gather(early, late))
        await node.close()
        return results

    assert run(main) == [{"n": 2.0}] * 2


STREAM_ENDS = [
    pytest.param(None, id="eof"),
    pytest.param(
        grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
        ),
        id="rpc-error",
    ),
    pytest.param(pb.ReduceResponse(), id="answer-to-no-request"),
]


@pytest.mark.parametrize("end", STREAM_ENDS)
def test_a_broken_stream_is_reopened_and_unanswered_requests_are_resent(end, scripted_node):
    """The stream ends with step 1 upstream and step 2 collecting: the node opens a
    new stream, sends step 1's request again, unchanged, and every rank gets the
    answer that comes back there; step 2 then goes up the new stream."""

    async def main() -> list[Any]:
        node, channel = await scripted_node()
        upstream = both(node, 1)
        collecting = reduce(node, 0, 2, 3.0)
        first = await channel.call(0)
        await first.until(written=1)
        first.answers.put_nowait(end)
        second = await channel.call(1)
        await second.until(written=1)
        assert second.written == first.written
        second.answer_ok(1)
        results = list(await asyncio.gather(*upstream))
        late = reduce(node, 1, 2, 3.0)
        await second.until(written=2)
        second.answer_ok(1)
        results += await asyncio.gather(collecting, late)
        await node.close()
        return results

    assert run(main) == [{"n": 4.0}] * 2 + [{"n": 6.0}] * 2


@pytest.mark.parametrize("end", STREAM_ENDS)
def test_a_broken_stream_past_the_retry_budget_fails_the_waiting_ranks(end, scripted_node):
    """Without a retry budget, each waiting rank gets CoordinatorUnavailableError
    naming its step and the coordinator, without waiting for the node's (hour-long)
    deadline; a rank that retries makes the node send its request again."""

    async def main() -> list[Any]:
        node, channel = await scripted_node(retry_budget_s=0.0)
        upstream = both(node, 1)
        first = await channel.call(0)
        await first.until(written=1)
        first.answers.put_nowait(end)
        failed = list(await asyncio.gather(*upstream, return_exceptions=True))
        retried = both(node, 1)
        second = await channel.call(1)
        await second.until(written=1)
        assert second.written == first.written
        second.answer_ok(1)
        failed += await asyncio.gather(*retried)
        await node.close()
        return failed

    results = run(main)
    assert all(isinstance(r, CoordinatorUnavailableError) for r in results[:2]), results
    assert [r.step for r in results[:2]] == [1, 1]
    assert "job 'j' group 'g' step 1" in str(results[0])
    assert "the coordinator at scripted is unavailable" in str(results[0])
    assert results[2:] == [{"n": 4.0}] * 2


def test_close_fails_the_ranks_still_waiting(scripted_node):
    async def main() -> list[Any]:
        node, channel = await scripted_node(timeout_s=3600.0)
        upstream = both(node, 1)
        collecting = reduce(node, 0, 2, 1.0)
        call = await channel.call(0)
        await call.until(written=1)
        await node.close()
        after = reduce(node, 0, 3, 1.0)
        return await asyncio.gather(*upstream, collecting, after, return_exceptions=True)

    results = run(main)
    assert all(isinstance(r, CoordinatorUnavailableError) for r in results), results
    assert [r.step for r in results] == [1, 1, 2, 3]
    assert all("closed" in str(r) for r in results)
