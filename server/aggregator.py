"""Hierarchical aggregation: one contribution per node instead of one per rank.

A node-local aggregator (the rank-0 worker of a node, or a per-node agent)
collects the partials of the ranks on its node, checks each rank's
contribution with the shared rules, and sends the coordinator *one*
``ReduceRequest`` whose ``covered_ranks`` lists those ranks and whose partials
carry the exact per-term sum as a non-overlapping expansion
(:mod:`lossreduce.server.expansion`), plus how many ranks sent 0. The
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
shell around one upstream ``ReduceStream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from lossreduce.errors import (
    ConflictingContributionError,
    CoordinatorUnavailableError,
    InvalidPartialError,
    LossReduceError,
    describe_round,
    from_status,
)
from lossreduce.rules import check_partial, check_term_name
from lossreduce.server.expansion import ExpansionOverflowError, exact_expansion
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

__all__ = ["NodeAggregator", "RankContribution", "node_requests"]


@dataclass(frozen=True, slots=True)
class RankContribution:
    """One local rank's contribution to one round, as it would send it alone."""

    rank: int
    world_size: int
    terms: tuple[str, ...]
    values: tuple[float, ...]
    contracts: tuple[str, ...]

    def request(self, key: pb.RoundKey) -> pb.ReduceRequest:
        """This rank's own single-rank request (the fallback path)."""
        return pb.ReduceRequest(
            round=key,
            rank=self.rank,
            world_size=self.world_size,
            partials=[
                pb.TermPartial(term=t, value=v, contract=c)
                for t, v, c in zip(self.terms, self.values, self.contracts, strict=True)
            ],
        )


@functools.lru_cache(maxsize=256)
def _terms_ok(terms: tuple[str, ...]) -> bool:
    # A node sends the same few term tuples every step: check each tuple's names once.
    return bool(terms) and len(set(terms)) == len(terms) and not any(map(check_term_name, terms))


def _valid_alone(c: RankContribution) -> bool:
    if not 0 <= c.rank < c.world_size or not _terms_ok(c.terms):
        return False
    return all(check_partial(v) is None for v in c.values)


def node_requests(
    key: pb.RoundKey, contributions: Sequence[RankContribution]
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
    if not (agree and distinct and all(_valid_alone(c) for c in ordered)):
        return [c.request(key) for c in ordered]
    partials = []
    for index, (term, contract) in enumerate(zip(first.terms, first.contracts, strict=True)):
        column = [c.values[index] for c in ordered]  # [local ranks], in rank order
        try:
            expansion = exact_expansion(column)
        except ExpansionOverflowError:
            # The coordinator reports an overflowing normalizer for the whole round.
            return [c.request(key) for c in ordered]
        partials.append(
            pb.TermPartial(
                term=term,
                value=math.fsum(expansion),  # the rounded sum; ``expansion`` is what is summed
                contract=contract,
                expansion=expansion,
                zero_ranks=column.count(0.0),
            )
        )
    return [
        pb.ReduceRequest(
            round=key,
            rank=first.rank,
            world_size=first.world_size,
            partials=partials,
            covered_ranks=[c.rank for c in ordered],
        )
    ]


class _Step:
    """One round as seen by the node: local arrivals and every rank's answer."""

    __slots__ = ("answers", "arrived", "done", "timer")

    def __init__(self) -> None:
        self.arrived: dict[int, RankContribution] = {}
        self.answers: dict[int, _Answer] = {}
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.timer: asyncio.TimerHandle | None = None


# A response and its normalizers decoded once (every rank of an aggregate shares it).
_Answer = tuple[pb.ReduceResponse, dict[str, float]]


class NodeAggregator:
    """The aggregator of one node: local ranks call :meth:`reduce`; the node
    sends the coordinator one contribution per round over one stream.

    Use as ``async with NodeAggregator(channel, job=..., group=..., local_ranks=...)``.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        job: str,
        group: str,
        local_ranks: Sequence[int],
        timeout_s: float = 300.0,
    ) -> None:
        if not local_ranks:
            raise ValueError(f"job {job!r} group {group!r}: a node aggregator needs local ranks")
        self._job, self._group = job, group
        self._local = frozenset(local_ranks)
        self._timeout_s = timeout_s
        self._stub = pb_grpc.ReductionCoordinatorStub(channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._steps: dict[int, _Step] = {}
        self._in_flight: deque[tuple[int, tuple[int, ...]]] = deque()
        """Requests written upstream, oldest first: (step, the local ranks each answers)."""
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> NodeAggregator:
        """Open the upstream stream (on the running loop); returns ``self``."""
        self._call = self._stub.ReduceStream()
        self._reader = asyncio.create_task(self._read_answers())
        return self

    async def close(self) -> None:
        """Close the upstream stream and stop reading answers."""
        if self._call is not None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self._call.done_writing()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def __aenter__(self) -> NodeAggregator:
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def reduce(
        self,
        rank: int,
        world_size: int,
        step: int,
        partials: Mapping[str, float],
        contracts: Mapping[str, str],
    ) -> dict[str, float]:
        """Rank ``rank``'s contribution to ``step``; returns the global normalizers
        once the round completes, or raises the round's :mod:`lossreduce.errors` error."""
        terms = tuple(partials)
        mine = RankContribution(
            rank=rank,
            world_size=world_size,
            terms=terms,
            values=tuple(map(float, partials.values())),
            contracts=tuple([contracts.get(t, "") for t in terms]),
        )
        state = await self._arrive(step, [mine])
        # shield: a cancelled rank must not cancel the answer its node peers wait for.
        await asyncio.shield(state.done)
        return self._answer(step, rank, state)

    async def reduce_node(
        self, step: int, contributions: Sequence[RankContribution]
    ) -> list[dict[str, float] | LossReduceError]:
        """Every local rank's contribution at once (a node agent that already holds
        them); each rank's normalizers or error, in the order given."""
        state = await self._arrive(step, contributions)
        await asyncio.shield(state.done)
        results: list[dict[str, float] | LossReduceError] = []
        for c in contributions:
            try:
                results.append(self._answer(step, c.rank, state))
            except LossReduceError as err:
                results.append(err)
        return results

    async def _arrive(self, step: int, contributions: Sequence[RankContribution]) -> _Step:
        state = self._steps.get(step)
        if state is None:
            state = self._steps[step] = _Step()
            # One deadline per round, not one timer per rank.
            state.timer = asyncio.get_running_loop().call_later(
                self._timeout_s, self._expire, step, state
            )
        complete_before = len(state.arrived) == len(self._local)
        for c in contributions:
            self._check_local(step, c, state.arrived.get(c.rank))
            state.arrived[c.rank] = c
        if not complete_before and len(state.arrived) == len(self._local):
            await self._send(step, state)
        return state

    def _check_local(
        self, step: int, c: RankContribution, previous: RankContribution | None
    ) -> None:
        where = describe_round(self._job, self._group, step)
        if c.rank not in self._local:
            raise InvalidPartialError(
                f"{where}: rank {c.rank} is not a local rank of this node {sorted(self._local)}",
                job=self._job,
                group=self._group,
                step=step,
                rank=c.rank,
                ranks=(c.rank,),
            )
        if previous is not None and previous != c:
            raise ConflictingContributionError(
                f"{where}: rank {c.rank} already gave this node {previous.values} and now "
                f"{c.values}; the round keeps the first contribution",
                job=self._job,
                group=self._group,
                step=step,
                rank=c.rank,
                terms=c.terms,
                values=c.values,
                ranks=(c.rank,),
            )

    def _answer(self, step: int, rank: int, state: _Step) -> dict[str, float]:
        response, normalizers = state.answers[rank]
        if response.HasField("error") and response.error.code != 0:
            raise from_status(
                response.error, job=self._job, group=self._group, step=step, rank=rank
            )
        return dict(normalizers)

    def _expire(self, step: int, state: _Step) -> None:
        if state.done.done():
            return
        state.done.set_exception(
            CoordinatorUnavailableError(
                f"{describe_round(self._job, self._group, step)}: no answer within "
                f"{self._timeout_s:g} s (local ranks arrived: {sorted(state.arrived)} of "
                f"{sorted(self._local)})",
                job=self._job,
                group=self._group,
                step=step,
            )
        )

    async def _send(self, step: int, state: _Step) -> None:
        assert self._call is not None, "use the aggregator as an async context manager"
        key = pb.RoundKey(job=self._job, group=self._group, step=step)
        requests = node_requests(key, list(state.arrived.values()))
        async with self._write_lock:  # FIFO: requests go out in the order they were queued
            for request in requests:
                covered = tuple(request.covered_ranks) or (request.rank,)
                self._in_flight.append((step, covered))
                await self._call.write(request)

    async def _read_answers(self) -> None:
        assert self._call is not None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                step, covered = self._in_flight.popleft()
                state = self._steps[step]
                answer = (response, {n.term: n.value for n in response.normalizers})
                for rank in covered:
                    state.answers[rank] = answer
                if len(state.answers) == len(self._local) and not state.done.done():
                    if state.timer is not None:
                        state.timer.cancel()
                    state.done.set_result(None)
                    self._forget_before(step)
        except grpc.aio.AioRpcError as err:
            failure = CoordinatorUnavailableError(
                f"job {self._job!r} group {self._group!r}: the node's stream to the "
                f"coordinator failed: {err.code().name}: {err.details()}",
                job=self._job,
                group=self._group,
            )
            for state in self._steps.values():
                if not state.done.done():
                    state.done.set_exception(failure)

    def _forget_before(self, step: int) -> None:
        # Keep a few finished steps for local retries; drop older ones.
        for old in [s for s in self._steps if s < step - 8]:
            del self._steps[old]
