"""Hierarchical aggregation: one contribution per node instead of one per rank.

A node-local aggregator (the rank-0 worker of a node, or a per-node agent)
collects the partials of the ranks on its node, judges each rank's
contribution alone as the coordinator would
(:func:`lossreduce.contribution_check.check_contribution`), and sends the coordinator *one*
``ReduceRequest`` whose ``covered_ranks`` lists those ranks and whose partials
carry the exact per-term sum as a non-overlapping expansion
(:mod:`lossreduce.client.expansion`), plus how many ranks sent 0. The
coordinator's answer is handed to every local rank.

Guarantees kept:

- exactness: the global normalizer is bit-identical to ``math.fsum`` over all
  ranks in rank order, however ranks are grouped into nodes;
- validation names the culprit rank: when any local rank's contribution is
  invalid on its own or disagrees with its node peers (world size, term names,
  contracts), the aggregator forwards every local rank's own contribution
  unchanged, so the coordinator judges them exactly as without aggregation
  (the culprit gets INVALID_ARGUMENT, everyone else ABORTED naming it);
- idempotency: the aggregated request is a pure function of the local
  contributions, so a re-sent identical request gets the identical outcome.

:func:`node_requests` is the pure part; :class:`NodeAggregator` the asyncio
shell around one upstream ``ReduceStream``, built and opened like
:class:`~lossreduce.client.AsyncReductionClient` (target, job, group, world
size, settings; ``open()``/``close()``); :meth:`NodeAggregator.local_rank` is
one local rank's view with the client's ``reduce(step, partials, contracts)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType

import grpc
from pydantic import Field

from lossreduce.client._transport import call_metadata, open_channel
from lossreduce.client.expansion import ExpansionOverflowError, exact_expansion
from lossreduce.client.settings import ClientSettings
from lossreduce.contribution import Contribution
from lossreduce.contribution_check import check_contribution
from lossreduce.errors import (
    ConflictingContributionError,
    CoordinatorUnavailableError,
    InvalidPartialError,
    LossReduceError,
    describe_round,
)
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["AggregatorSettings", "LocalRank", "NodeAggregator", "node_requests"]


class AggregatorSettings(ClientSettings):
    """How a node aggregator talks to the coordinator (as a client does) and how long
    it waits for its own ranks."""

    node_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Seconds the node waits for all its local ranks of a round before it hands the "
            "coordinator the ranks that arrived (and each later one as it arrives); the "
            "coordinator's round timeout then decides the round for every node alike."
        ),
    )


def node_requests(
    key: pb.RoundKey, contributions: Sequence[Contribution]
) -> list[pb.ReduceRequest]:
    """What a node sends upstream for one round: one aggregated request covering
    every local rank, or, when any contribution is invalid or disagrees with
    the first, every rank's own request (so the coordinator names the culprit)."""
    ordered = sorted(contributions, key=lambda c: c.rank)
    first = ordered[0]
    agree = all(
        c.world_size == first.world_size
        and c.terms == first.terms
        and c.contracts == first.contracts
        for c in ordered
    )
    distinct = len({c.rank for c in ordered}) == len(ordered)
    # Every contribution names the first one's terms: judge those names once.
    valid = (
        agree
        and distinct
        and check_contribution(first) is None
        and all(check_contribution(c, known_terms=first.terms) is None for c in ordered[1:])
    )
    if not valid:
        return [c.request(key) for c in ordered]
    expansions = []
    for index in range(len(first.terms)):
        column = [c.values[index] for c in ordered]  # [local ranks], in rank order
        try:
            expansions.append(exact_expansion(column))
        except ExpansionOverflowError:
            # The coordinator reports an overflowing normalizer for the whole round.
            return [c.request(key) for c in ordered]
    aggregated = Contribution(
        rank=first.rank,
        world_size=first.world_size,
        terms=first.terms,
        # The rounded sums; the expansions are what the coordinator sums.
        values=tuple(math.fsum(e) for e in expansions),
        contracts=first.contracts,
        covers=tuple(c.rank for c in ordered),
        expansions=tuple(expansions),
        zero_ranks=tuple(
            [sum(1 for c in ordered if c.values[i] == 0.0) for i in range(len(first.terms))]
        ),
    )
    return [aggregated.request(key)]


class _Step:
    """One round as seen by the node: local arrivals, what went upstream, and
    every rank's answer (or the node's failure to get one)."""

    __slots__ = ("answers", "arrived", "failure", "flushing", "sent", "timer", "updated")

    def __init__(self) -> None:
        self.arrived: dict[int, Contribution] = {}
        self.sent: set[int] = set()
        """Local ranks whose contribution went upstream (each goes once)."""
        self.answers: dict[int, _Answer] = {}
        """The coordinator's answer for each rank it answered."""
        self.failure: CoordinatorUnavailableError | None = None
        """Set when the stream ended before every arrived rank was answered."""
        self.flushing = False
        """The node's deadline passed with local ranks missing: each rank goes
        upstream as it arrives, and the coordinator decides the round."""
        self.timer: asyncio.TimerHandle | None = None
        self.updated: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved (then replaced) whenever answers come in or the step fails."""

    def notify(self) -> None:
        updated, self.updated = self.updated, asyncio.get_running_loop().create_future()
        updated.set_result(None)

    def settled(self) -> bool:
        """Every rank that arrived has its answer or the step failed, and nothing is in flight."""
        return self.failure is not None or (
            bool(self.arrived) and len(self.answers) == len(self.arrived)
        )


# A response and its normalizers decoded once (every rank of an aggregate shares it).
_Answer = tuple[pb.ReduceResponse, dict[str, float]]


class NodeAggregator:
    """The aggregator of one node: its local ranks reduce through it, and the node
    sends the coordinator one contribution per round over one stream.

    ::

        async with NodeAggregator(
            "10.0.0.1:50051", job="run-7", group="actor", local_ranks=(0, 1, 2, 3), world_size=8
        ) as node:
            rank = node.local_rank(2)
            normalizers = await rank.reduce(step, {"pg": tokens, "kl": tokens})

    Every local rank gets exactly the coordinator's answer for its round.
    ``settings.node_timeout_s`` only bounds how long the node waits for its own
    ranks: when it passes with local ranks missing, the node hands the
    coordinator the ranks that arrived (and each later one as it arrives), so
    the coordinator's round timeout decides the round for every node alike.
    Once a round is upstream the node waits for the coordinator's answer, which
    the coordinator's round timeout bounds; if the stream ends first, every
    rank still waiting gets :class:`~lossreduce.errors.CoordinatorUnavailableError`
    at once, and so does every later call. The channel is the client's (TLS,
    token and keepalive from ``settings``); it opens on :meth:`open` or the
    first call.
    """

    def __init__(
        self,
        target: str,
        *,
        job: str,
        group: str,
        local_ranks: Sequence[int],
        world_size: int,
        settings: AggregatorSettings | None = None,
    ) -> None:
        if not local_ranks:
            raise ValueError(f"job {job!r} group {group!r}: a node aggregator needs local ranks")
        if world_size < 1:
            raise ValueError(f"job {job!r} group {group!r}: world_size={world_size} must be >= 1")
        self.target = target
        self.job = job
        self.group = group
        self.world_size = world_size
        self.settings = settings if settings is not None else AggregatorSettings()
        self._local = frozenset(local_ranks)
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._steps: dict[int, _Step] = {}
        self._in_flight: deque[tuple[int, tuple[int, ...]]] = deque()
        """Requests written upstream, oldest first: (step, the local ranks each answers)."""
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self._ended: str | None = None
        """Why the stream to the coordinator is no longer usable (None while it is)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.target!r}, job={self.job!r}, group={self.group!r}, "
            f"local_ranks={sorted(self._local)}, world_size={self.world_size})"
        )

    async def open(self) -> None:
        """Open the channel and the upstream stream on the running loop (done implicitly
        by the first call); does nothing once open or closed."""
        if self._channel is not None or self._ended is not None:
            return
        self._channel = open_channel(self.target, self.settings)
        stub = pb_grpc.ReductionCoordinatorStub(self._channel)
        self._call = stub.ReduceStream(metadata=call_metadata(self.settings))
        self._reader = asyncio.create_task(self._read_answers())

    async def close(self) -> None:
        """Close the upstream stream and the channel; ranks still waiting, and every
        later call, get :class:`~lossreduce.errors.CoordinatorUnavailableError`."""
        if self._call is not None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self._call.done_writing()
        tasks = [*self._flushes, *([self._reader] if self._reader is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._end("the node aggregator was closed")
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> NodeAggregator:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def local_rank(self, rank: int) -> LocalRank:
        """Local rank ``rank``'s view of this node, with the client's ``reduce``."""
        if rank not in self._local:
            raise ValueError(
                f"job {self.job!r} group {self.group!r}: rank {rank} is not a local rank of "
                f"this node {sorted(self._local)}"
            )
        return LocalRank(self, rank)

    async def reduce_node(
        self, step: int, contributions: Sequence[Contribution]
    ) -> list[dict[str, float] | LossReduceError]:
        """Every local rank's contribution at once (a node agent that already holds
        them); each rank's normalizers or error, in the order given."""
        state = await self._arrive(step, contributions)
        await self._wait(state, [c.rank for c in contributions])
        results: list[dict[str, float] | LossReduceError] = []
        for c in contributions:
            try:
                results.append(self._answer(step, c.rank, state))
            except LossReduceError as err:
                results.append(err)
        return results

    async def _arrive(self, step: int, contributions: Sequence[Contribution]) -> _Step:
        await self.open()
        state = self._steps.get(step)
        if state is None:
            state = self._steps[step] = _Step()
            # One deadline per round, not one timer per rank.
            state.timer = asyncio.get_running_loop().call_later(
                self.settings.node_timeout_s, self._flush, step, state
            )
        for c in contributions:
            self._check_local(step, c, state.arrived.get(c.rank))
            state.arrived[c.rank] = c
        if self._ended is not None:
            self._fail(step, state)
        elif state.flushing or len(state.arrived) == len(self._local):
            await self._send(step, state)
        return state

    @staticmethod
    async def _wait(state: _Step, ranks: Iterable[int]) -> None:
        ranks = tuple(ranks)
        while state.failure is None and not all(r in state.answers for r in ranks):
            # shield: a cancelled rank must not cancel the wake-up its node peers wait for.
            await asyncio.shield(state.updated)

    def _check_local(self, step: int, c: Contribution, previous: Contribution | None) -> None:
        where = describe_round(self.job, self.group, step)
        if c.rank not in self._local:
            raise InvalidPartialError(
                f"{where}: rank {c.rank} is not a local rank of this node {sorted(self._local)}",
                job=self.job,
                group=self.group,
                step=step,
                rank=c.rank,
                ranks=(c.rank,),
            )
        if previous is not None and previous != c:
            raise ConflictingContributionError(
                f"{where}: rank {c.rank} already gave this node {previous.values} and now "
                f"{c.values}; the round keeps the first contribution",
                job=self.job,
                group=self.group,
                step=step,
                rank=c.rank,
                terms=c.terms,
                values=c.values,
                ranks=(c.rank,),
            )

    def _answer(self, step: int, rank: int, state: _Step) -> dict[str, float]:
        answer = state.answers.get(rank)
        if answer is None:
            assert state.failure is not None, f"step {step} rank {rank}: woken without an answer"
            raise state.failure
        response, normalizers = answer
        if response.HasField("error") and response.error.code != 0:
            raise from_status(response.error, job=self.job, group=self.group, step=step, rank=rank)
        return dict(normalizers)

    def _flush(self, step: int, state: _Step) -> None:
        """The node's deadline for ``step``: local ranks are missing, so the
        coordinator (not this node) decides the round from here on."""
        state.timer = None
        if state.failure is not None or len(state.sent) == len(self._local):
            return
        state.flushing = True
        task = asyncio.create_task(self._send(step, state))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send(self, step: int, state: _Step) -> None:
        """Send upstream the arrived local ranks not sent yet (each rank goes once)."""
        assert self._call is not None, "_arrive opens the stream before anything is sent"
        fresh = [c for r, c in state.arrived.items() if r not in state.sent]
        if not fresh:
            return
        state.sent.update(c.rank for c in fresh)
        if len(state.sent) == len(self._local) and state.timer is not None:
            state.timer.cancel()
            state.timer = None
        key = pb.RoundKey(job=self.job, group=self.group, step=step)
        requests = node_requests(key, fresh)
        try:
            async with self._write_lock:  # FIFO: requests go out in the order they were queued
                for request in requests:
                    if self._ended is not None:
                        break
                    covered = tuple(request.covered_ranks) or (request.rank,)
                    self._in_flight.append((step, covered))
                    await self._call.write(request)
        except grpc.aio.AioRpcError as err:
            self._end(f"writing to the coordinator failed: {err.code().name}: {err.details()}")
        except asyncio.InvalidStateError:
            self._end("the node's stream to the coordinator was closed for writing")
        if self._ended is not None:
            self._fail(step, state)

    async def _read_answers(self) -> None:
        assert self._call is not None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self._end("the coordinator ended the node's stream")
                    return
                if not self._in_flight:
                    self._end("the coordinator answered a request this node never sent")
                    return
                step, covered = self._in_flight.popleft()
                state = self._steps[step]
                answer = (response, {n.term: n.value for n in response.normalizers})
                for rank in covered:
                    state.answers[rank] = answer
                state.notify()
                if len(state.answers) == len(self._local):
                    self._forget_before(step)
        except grpc.aio.AioRpcError as err:
            self._end(
                f"the node's stream to the coordinator failed: {err.code().name}: {err.details()}"
            )

    def _end(self, reason: str) -> None:
        """The stream is unusable: fail every step still waiting, and every later one."""
        if self._ended is None:
            self._ended = reason
        for step, state in self._steps.items():
            self._fail(step, state)

    def _fail(self, step: int, state: _Step) -> None:
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if state.settled():
            return
        waiting = sorted(set(state.arrived) - set(state.answers))
        state.failure = CoordinatorUnavailableError(
            f"{describe_round(self.job, self.group, step)}: {self._ended}; local ranks "
            f"{waiting} got no answer (arrived: {sorted(state.arrived)} of {sorted(self._local)})",
            job=self.job,
            group=self.group,
            step=step,
            ranks=waiting,
        )
        state.notify()

    def _forget_before(self, step: int) -> None:
        # Keep a few finished steps for local retries; drop older settled ones. A step
        # still collecting its ranks or with a request in flight stays until it settles.
        for old in [s for s, st in self._steps.items() if s < step - 8 and st.settled()]:
            del self._steps[old]


class LocalRank:
    """One local rank of a :class:`NodeAggregator`: the rank side of
    :class:`~lossreduce.client.AsyncReductionClient` (the same ``reduce``), over
    the node's stream. Made by :meth:`NodeAggregator.local_rank`."""

    def __init__(self, node: NodeAggregator, rank: int) -> None:
        self.node = node
        self.job = node.job
        self.group = node.group
        self.rank = rank
        self.world_size = node.world_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.node!r}, rank={self.rank})"

    async def reduce(
        self,
        step: int,
        partials: Mapping[str, float],
        contracts: Mapping[str, str] | None = None,
    ) -> dict[str, float]:
        """This rank's partials for ``step`` in, the global normalizers out (identical on
        every rank); raises the round's :mod:`lossreduce.errors` error otherwise."""
        terms = tuple(partials)
        contracts = contracts or {}
        mine = Contribution(
            rank=self.rank,
            world_size=self.world_size,
            terms=terms,
            values=tuple(map(float, partials.values())),
            contracts=tuple([contracts.get(t, "") for t in terms]),
        )
        (result,) = await self.node.reduce_node(step, [mine])
        if isinstance(result, LossReduceError):
            raise result
        return result
