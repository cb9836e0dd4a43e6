"""Hierarchical aggregation: one contribution per node instead of one per rank.

A node-local aggregator (a per-node agent, :mod:`lossreduce.client.agent`)
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
  That is what makes the upstream stream safe to reopen: when it breaks, every
  request still unanswered is sent again, unchanged, over a new one (within
  the client's retry budget), and a decided round is answered from the
  coordinator's stored outcome.

:func:`~lossreduce.client.aggregation.node_requests` is the pure part
(:mod:`lossreduce.client.aggregation`); :class:`NodeAggregator` the asyncio
shell around one upstream ``ReduceStream`` (the client's own
:class:`~lossreduce.client._stream.ReduceStreamSession`, credentials, backoff
and error decoding), built and opened like
:class:`~lossreduce.client.AsyncReductionClient`; :meth:`NodeAggregator.respond`
hands back the coordinator's own responses (what an agent forwards to its
ranks), :meth:`NodeAggregator.local_rank` is one local rank's view with the
client's ``reduce(step, partials, contracts)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType

from google.rpc import code_pb2

from lossreduce.client._wire import RoundContext, decode_status, parse_response
from lossreduce.client.aggregation import (
    FALLBACK_INVALID,
    FALLBACK_NODE_TIMEOUT,
    FALLBACK_REGROUPED,
    FALLBACK_UNKNOWN_RANKS,
    AggregatorObserver,
    AggregatorSettings,
    node_requests,
)
from lossreduce.client.local_rank import LocalRank
from lossreduce.client.upstream import UpstreamStream, node_failure
from lossreduce.contribution import Contribution
from lossreduce.errors import (
    ConflictingContributionError,
    InvalidPartialError,
    LossReduceError,
    UsageError,
    describe_round,
)
from lossreduce.v2 import coordinator_pb2 as pb

# The pure half (what goes upstream, settings, observer) lives in .aggregation;
# re-exported here, where callers have always imported it from.
__all__ = [
    "FALLBACK_INVALID",
    "FALLBACK_NODE_TIMEOUT",
    "FALLBACK_REGROUPED",
    "FALLBACK_UNKNOWN_RANKS",
    "AggregatorObserver",
    "AggregatorSettings",
    "LocalRank",
    "NodeAggregator",
    "node_requests",
]


class _Send:
    """One request of a round upstream, and the local ranks its answer is for."""

    __slots__ = ("covered", "request", "task")

    def __init__(self, request: pb.ReduceRequest) -> None:
        self.request = request
        self.covered: tuple[int, ...] = tuple(request.covered_ranks) or (request.rank,)
        self.task: asyncio.Task[None] | None = None


class _Step:
    """One round as seen by the node: local arrivals, what went upstream, and
    every rank's answer."""

    __slots__ = (
        "answers",
        "arrived",
        "fallback",
        "flushing",
        "sends",
        "sent",
        "started",
        "timer",
        "transient",
        "updated",
    )

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.arrived: dict[int, Contribution] = {}
        self.sent: set[int] = set()
        """Local ranks whose contribution went upstream (each goes once)."""
        self.sends: list[_Send] = []
        self.answers: dict[int, pb.ReduceResponse] = {}
        """The answer for each rank answered: the coordinator's, or the node's own failure."""
        self.transient: set[int] = set()
        """Ranks whose answer is the node's own failure: a retry of theirs sends again."""
        self.fallback: str | None = None
        self.flushing = False
        """Each rank goes upstream as it arrives: the node's deadline passed with local
        ranks missing (the coordinator decides the round), or the local ranks are unknown."""
        self.timer: asyncio.TimerHandle | None = None
        self.started = loop.time()
        self.updated: asyncio.Future[None] = loop.create_future()
        """Resolved (then replaced) whenever answers come in."""

    def notify(self) -> None:
        updated, self.updated = self.updated, asyncio.get_running_loop().create_future()
        updated.set_result(None)

    def settled(self) -> bool:
        """Every rank that arrived has its answer."""
        return bool(self.arrived) and len(self.answers) == len(self.arrived)


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
    ``local_ranks=None`` learns them: until a round succeeds every rank goes up
    alone, then the ranks of that round are the node's.

    Once a round is upstream the node waits for the coordinator's answer, which
    the coordinator's round timeout bounds. If the stream breaks, the node opens
    a new one and sends every unanswered request again (UNAVAILABLE is retried
    with the client's backoff within ``retry_budget_s``); when that budget is
    spent, or the coordinator refuses the node's credentials, each waiting rank
    gets that failure (:class:`~lossreduce.errors.CoordinatorUnavailableError`,
    :class:`~lossreduce.errors.AuthenticationError`), and a rank that retries
    makes the node try again. The channel is the client's (TLS, token and
    keepalive from ``settings``); it opens on :meth:`open` or the first call.
    """

    def __init__(
        self,
        target: str,
        *,
        job: str,
        group: str,
        local_ranks: Sequence[int] | None,
        world_size: int,
        settings: AggregatorSettings | None = None,
        observer: AggregatorObserver | None = None,
        run: str = "",
    ) -> None:
        if local_ranks is not None and not local_ranks:
            raise UsageError(
                f"job {job!r} group {group!r}: a node aggregator needs local ranks",
                job=job,
                group=group,
            )
        if world_size < 1:
            raise UsageError(
                f"job {job!r} group {group!r}: world_size={world_size} must be >= 1",
                job=job,
                group=group,
            )
        self.target = target
        self.job = job
        self.group = group
        self.world_size = world_size
        self.run = run
        """The run its local ranks' contributions name (:meth:`local_rank`); empty: none."""
        self.settings = settings if settings is not None else AggregatorSettings()
        self._observer = observer
        self._local = None if local_ranks is None else frozenset(local_ranks)
        self._upstream = UpstreamStream(target, self.settings, self._reconnected)
        self._steps: dict[int, _Step] = {}
        self._flushes: set[asyncio.Task[None]] = set()
        self._opened = False
        self._closed = False

    def __repr__(self) -> str:
        local = "learned" if self._local is None else sorted(self._local)
        return (
            f"{type(self).__name__}({self.target!r}, job={self.job!r}, group={self.group!r}, "
            f"local_ranks={local}, world_size={self.world_size})"
        )

    @property
    def local_ranks(self) -> tuple[int, ...] | None:
        """The node's ranks, in order; None while they are still to be learned."""
        return None if self._local is None else tuple(sorted(self._local))

    async def open(self) -> None:
        """Open the channel on the running loop (done implicitly by the first call);
        does nothing once open or closed."""
        if not self._opened and not self._closed:
            self._opened = True
            self._upstream.open()

    async def close(self) -> None:
        """Close the upstream stream and the channel; ranks still waiting, and every
        later call, get :class:`~lossreduce.errors.CoordinatorUnavailableError`."""
        self._closed = True
        await self._upstream.close()
        for task in list(self._flushes):
            task.cancel()
        tasks = [*self._flushes, *self._send_tasks()]
        await asyncio.gather(*tasks, return_exceptions=True)
        for step, state in self._steps.items():
            self._answer_closed(step, state)

    async def settle(self) -> None:
        """Return once every request sent upstream so far has its answer (cancelling
        this wait leaves the requests going)."""
        tasks = self._send_tasks()
        if tasks:
            await asyncio.wait(tasks)

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

    def serves(self, rank: int) -> bool:
        """Whether ``rank`` is a local rank of this node (any rank while they are unknown)."""
        return self._local is None or rank in self._local

    def local_rank(self, rank: int) -> LocalRank:
        """Local rank ``rank``'s view of this node, with the client's ``reduce``."""
        if not self.serves(rank):
            raise UsageError(
                f"job {self.job!r} group {self.group!r}: rank {rank} is not a local rank of "
                f"this node {self.local_ranks}",
                job=self.job,
                group=self.group,
                rank=rank,
            )
        return LocalRank(self, rank)

    async def forward_alone(self, request: pb.ReduceRequest) -> pb.ReduceResponse:
        """Send one request upstream outside any round the node aggregates; its answer."""
        await self.open()
        response, _ = await self._upstream.submit(request)
        return response

    async def respond(
        self, step: int, contributions: Sequence[Contribution]
    ) -> list[pb.ReduceResponse]:
        """The answer to each local rank's contribution, in the order given: the
        coordinator's own response (error included), or the node's failure to get it.

        Raises :class:`~lossreduce.errors.InvalidPartialError` for a rank that is not
        local, :class:`~lossreduce.errors.ConflictingContributionError` for a rank that
        gave this node another contribution for the round; nothing is sent then.
        """
        state = await self._arrive(step, contributions)
        ranks = [c.rank for c in contributions]
        while not all(r in state.answers for r in ranks):
            # shield: a cancelled rank must not cancel the wake-up its node peers wait for.
            await asyncio.shield(state.updated)
        return [state.answers[r] for r in ranks]

    async def reduce_node(
        self, step: int, contributions: Sequence[Contribution]
    ) -> list[dict[str, float] | LossReduceError]:
        """Every local rank's contribution at once; each rank's normalizers or error
        (decoded as the client decodes them), in the order given."""
        responses = await self.respond(step, contributions)
        results: list[dict[str, float] | LossReduceError] = []
        for c, response in zip(contributions, responses, strict=True):
            ctx = RoundContext(self.job, self.group, step, c.rank, c.world_size)
            if response.error.code != code_pb2.OK:
                results.append(decode_status(response.error, ctx))
                continue
            try:
                results.append(dict(parse_response(response, ctx).normalizers))
            except LossReduceError as err:
                results.append(err)
        return results

    def _send_tasks(self) -> list[asyncio.Task[None]]:
        return [
            s.task
            for state in self._steps.values()
            for s in state.sends
            if s.task is not None and not s.task.done()
        ]

    def _reconnected(self) -> None:
        if self._observer is not None:
            self._observer.upstream_reconnected(self.job, self.group)

    def _fall_back(self, state: _Step, reason: str) -> None:
        if state.fallback is None:
            state.fallback = reason
            if self._observer is not None:
                self._observer.fell_back(self.job, self.group, reason)

    async def _arrive(self, step: int, contributions: Sequence[Contribution]) -> _Step:
        await self.open()
        state = self._steps.get(step)
        if state is None:
            state = self._steps[step] = _Step()
            if self._local is None:
                state.flushing = True
                self._fall_back(state, FALLBACK_UNKNOWN_RANKS)
            else:
                # One deadline per round, not one timer per rank.
                state.timer = asyncio.get_running_loop().call_later(
                    self.settings.node_timeout_s, self._flush, step, state
                )
        for c in contributions:
            self._check_local(step, c, state.arrived.get(c.rank))
        retried = [c.rank for c in contributions if c.rank in state.transient]
        for c in contributions:
            state.arrived[c.rank] = c
        if self._closed:
            self._answer_closed(step, state)
            return state
        for rank in retried:
            self._resend(step, state, rank)
        if state.flushing or (self._local is not None and len(state.arrived) == len(self._local)):
            self._send(step, state)
        return state

    def _check_local(self, step: int, c: Contribution, previous: Contribution | None) -> None:
        where = describe_round(self.job, self.group, step)
        if not self.serves(c.rank):
            raise InvalidPartialError(
                f"{where}: rank {c.rank} is not a local rank of this node {self.local_ranks}",
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

    def _flush(self, step: int, state: _Step) -> None:
        """The node's deadline for ``step``: local ranks are missing, so the
        coordinator (not this node) decides the round from here on."""
        state.timer = None
        if self._closed or (self._local is not None and len(state.sent) == len(self._local)):
            return
        state.flushing = True
        self._fall_back(state, FALLBACK_NODE_TIMEOUT)
        self._send(step, state)

    def _send(self, step: int, state: _Step) -> None:
        """Send upstream the arrived local ranks not sent yet (each rank goes once)."""
        fresh = [c for r, c in state.arrived.items() if r not in state.sent]
        if not fresh:
            return
        state.sent.update(c.rank for c in fresh)
        complete = self._local is not None and len(state.sent) == len(self._local)
        if complete and state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if not state.sends and self._observer is not None:
            self._observer.round_forwarded(self.job, self.group)
        key = pb.RoundKey(job=self.job, group=self.group, step=step)
        requests = node_requests(key, fresh)
        if len(fresh) > 1 and not requests[0].covered_ranks:
            self._fall_back(state, FALLBACK_INVALID)
        for request in requests:
            send = _Send(request)
            state.sends.append(send)
            # Tasks start in creation order, so requests reach the stream in this order.
            send.task = asyncio.create_task(self._deliver(step, state, send))

    def _resend(self, step: int, state: _Step, rank: int) -> None:
        """A rank retries after the node's own failure: send its request again."""
        for send in state.sends:
            if rank in send.covered and (send.task is None or send.task.done()):
                for r in send.covered:
                    state.answers.pop(r, None)
                    state.transient.discard(r)
                send.task = asyncio.create_task(self._deliver(step, state, send))
                return

    async def _deliver(self, step: int, state: _Step, send: _Send) -> None:
        response, own = await self._upstream.submit(send.request)
        if not own and len(send.covered) > 1 and response.error.code == code_pb2.ALREADY_EXISTS:
            # The coordinator counted some of these ranks in another grouping (this
            # agent restarted, or its deadline split the round): each goes alone, so
            # the counted ones get the round's answer and a changed one is named.
            self._fall_back(state, FALLBACK_REGROUPED)
            key = pb.RoundKey(job=self.job, group=self.group, step=step)
            state.sends.remove(send)
            for rank in send.covered:
                single = _Send(state.arrived[rank].request(key))
                state.sends.append(single)
                single.task = asyncio.create_task(self._deliver(step, state, single))
            return
        was_settled = state.settled()
        for rank in send.covered:
            state.answers[rank] = response
            if own:
                state.transient.add(rank)
        if own and self._observer is not None and not self._closed:
            self._observer.upstream_failed(
                self.job, self.group, code_pb2.Code.Name(response.error.code)
            )
        state.notify()
        if state.settled() and not was_settled:
            self._on_settled(step, state)

    def _on_settled(self, step: int, state: _Step) -> None:
        if self._observer is not None:
            seconds = asyncio.get_running_loop().time() - state.started
            self._observer.round_answered(self.job, self.group, seconds)
        succeeded = all(r.error.code == code_pb2.OK for r in state.answers.values())
        if self._local is None and succeeded:
            # Every rank of the world contributed, so every rank of this node came here.
            self._local = frozenset(state.arrived)
        # Keep a few finished steps for local retries; drop older settled ones. A step
        # still collecting its ranks or with a request in flight stays until it settles.
        for old in [s for s, st in self._steps.items() if s < step - 8 and st.settled()]:
            del self._steps[old]

    def _answer_closed(self, step: int, state: _Step) -> None:
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        waiting = [c for r, c in state.arrived.items() if r not in state.answers]
        if not waiting:
            return
        key = pb.RoundKey(job=self.job, group=self.group, step=step)
        for c in waiting:
            state.answers[c.rank] = node_failure(
                c.request(key), code_pb2.CANCELLED, "the node aggregator was closed"
            )
            state.transient.add(c.rank)
        state.notify()
