"""The pure part of the client: requests in, results or typed errors out.

No gRPC and no event loop here, so every conversion (numbers and 0-d tensors to
doubles, responses to :class:`RoundResult`, statuses to exceptions carrying the
client's own job, group, step and rank) is unit-testable alone.

Nothing a rank sends is refused before sending, so its peers never wait for
the round timeout because of it. A NaN, infinite or negative partial, a bad
term name or a rank outside the world is sent as given: the coordinator then
answers this rank with :class:`InvalidPartialError` and every peer with
:class:`RoundAbortedError` naming this rank, at once. What cannot be encoded
(a value that is not a number, a tensor with more than one element, a
contract for a term that has no partial) is sent as a NaN partial for that
term, which the coordinator rejects the same way; this rank then raises its
own :class:`InvalidPartialError` saying what was wrong locally
(:attr:`Outgoing.local_error`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from google.rpc import code_pb2, status_pb2

from lossreduce.client.types import PartialValue, RoundResult, SupportsItem
from lossreduce.errors import (
    ClientClosedError,
    CoordinatorUnavailableError,
    InvalidPartialError,
    LossReduceError,
    RankContext,
    describe_round,
)
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb

__all__ = [
    "Outgoing",
    "RoundContext",
    "build_request",
    "closed_error",
    "coerce_partial",
    "deadline_error",
    "decode_status",
    "normalizers_of",
    "parse_response",
    "unavailable_error",
]


@dataclass(frozen=True)
class RoundContext(RankContext):
    """Where a call happens; every error the client raises names all of it."""

    world_size: int
    run: str = ""
    """The run every request names (empty: none, as clients before runs did)."""

    @property
    def key(self) -> pb.RoundKey:
        """The round this call contributes to."""
        return pb.RoundKey(job=self.job, group=self.group, step=self.step)


@dataclass(frozen=True)
class Outgoing:
    """One call's request, and the error this rank raises whatever the answer.

    ``local_error`` is set when some partial or contract could not be encoded:
    the request then carries a NaN partial for each such term, so the
    coordinator aborts the round for every peer, and this rank raises
    ``local_error`` (chained to the coordinator's answer) rather than that answer.
    """

    request: pb.ReduceRequest
    local_error: InvalidPartialError | None


def coerce_partial(term: str, value: object, ctx: RoundContext) -> float:
    """``value`` as a double, or InvalidPartialError when it cannot be one.

    Accepts ints and floats and anything with ``.item()`` and no dimensions
    (0-d torch tensors, numpy scalars), without importing torch.
    """
    double = _as_double(value)
    if isinstance(double, str):
        raise ctx.error(InvalidPartialError, _not_a_number(term, double), terms=[term])
    return double


def _as_double(value: object) -> float | str:
    """``value`` as a double, or why it is not a number."""
    if isinstance(value, bool):
        return "a bool is not a partial normalizer"
    if isinstance(value, int | float):
        return float(value)
    # What isinstance(value, SupportsItem) checks, without a runtime Protocol
    # check's cost on every tensor partial.
    if callable(getattr(value, "item", None)):
        scalar = cast(SupportsItem, value)
        ndim = getattr(scalar, "ndim", 0)
        if ndim != 0:
            shape = tuple(getattr(scalar, "shape", ()))
            return f"a partial must be a 0-d tensor, got shape {list(shape)}"
        item = scalar.item()
        if isinstance(item, int | float) and not isinstance(item, bool):
            return float(item)
    return f"got {type(value).__name__}"


def _not_a_number(term: str, why: str) -> str:
    return f"partial for term {term!r} is not a number ({why})"


def build_request(
    ctx: RoundContext,
    partials: Mapping[str, PartialValue],
    contracts: Mapping[str, str] | None = None,
) -> Outgoing:
    """The ReduceRequest for this rank's partials, terms in mapping order.

    Terms that only ``contracts`` names follow, with a NaN partial; so does
    any value that is not a number (see :class:`Outgoing`).
    """
    contracts = contracts or {}
    # Filled in place, as Contribution.request does: this runs on every round.
    request = pb.ReduceRequest(rank=ctx.rank, world_size=ctx.world_size, run=ctx.run)
    key = request.round
    key.job, key.group, key.step = ctx.job, ctx.group, ctx.step
    add = request.partials.add
    problems: list[str] = []
    poisoned: list[str] = []
    for term, value in partials.items():
        double = value if type(value) is float else _as_double(value)
        if isinstance(double, str):
            problems.append(_not_a_number(term, double))
            poisoned.append(term)
            double = math.nan
        add(term=term, value=double, contract=contracts.get(term, ""))
    unknown = [t for t in contracts if t not in partials]
    if unknown:
        problems.append(
            f"contracts name terms {unknown} that have no partial (terms: {list(partials)})"
        )
        poisoned.extend(unknown)
        for term in unknown:
            add(term=term, value=math.nan, contract=contracts[term])
    local_error = None
    if problems:
        local_error = ctx.error(
            InvalidPartialError,
            f"{'; '.join(problems)}; sent NaN for {poisoned} instead, so the coordinator "
            "aborts the round for every rank",
            terms=poisoned,
        )
    return Outgoing(request, local_error)


def normalizers_of(response: pb.ReduceResponse, ctx: RoundContext) -> dict[str, float]:
    """Term -> global normalizer of a successful response (``error`` unset or OK)."""
    key = response.round
    if key.step != ctx.step or key.job != ctx.job or key.group != ctx.group:
        raise ctx.error(
            LossReduceError,
            f"the coordinator answered for {describe_round(key.job, key.group, key.step)} instead",
        )
    normalizers: dict[str, float] = {}
    finite = True
    for n in response.normalizers:
        value = normalizers[n.term] = n.value
        # The coordinator validated these; a non-finite value here would silently
        # turn every scaled loss into NaN, so it is worth one cheap re-check.
        finite = finite and math.isfinite(value)
    if not finite:
        bad = {term: value for term, value in normalizers.items() if not math.isfinite(value)}
        raise ctx.error(
            LossReduceError,
            f"the coordinator returned non-finite normalizers {bad}",
            terms=list(bad),
            values=list(bad.values()),
        )
    return normalizers


def parse_response(response: pb.ReduceResponse, ctx: RoundContext) -> RoundResult:
    """The RoundResult of a successful response (``error`` unset or OK)."""
    return RoundResult(
        step=ctx.step,
        normalizers=normalizers_of(response, ctx),
        zero_ranks={n.term: n.zero_ranks for n in response.normalizers},
    )


def decode_status(status: status_pb2.Status, ctx: RoundContext) -> LossReduceError:
    """The exception for a failed round, carrying this client's context.

    Round errors are built once per round by the coordinator and shared by
    every rank, so they name the culprit but not the receiving rank; the
    client adds its own rank to the attributes and to the message.
    """
    err = from_status(status, job=ctx.job, group=ctx.group, step=ctx.step)
    message = err.message
    where = describe_round(ctx.job, ctx.group, ctx.step)
    if where not in message:
        # Statuses raised by gRPC itself (message size, transport) name nothing.
        message = f"{where}: {message}"
    if err.rank is None:
        message = f"{message} (reported to rank {ctx.rank} of {ctx.world_size})"
    if ctx.run and f"run {ctx.run!r}" not in message:
        # With many runs on one coordinator, which launch failed matters as much as where.
        message = f"{message} [run {ctx.run!r}]"
    # Fresh from the decoder and ours alone: completed in place, which keeps what
    # a subclass carries beyond the common fields (a run conflict's holder).
    err.args = (message,)
    err.message = message
    err.job = err.job or ctx.job
    err.group = err.group or ctx.group
    err.step = ctx.step if err.step is None else err.step
    err.rank = ctx.rank if err.rank is None else err.rank
    err.run = err.run or ctx.run
    return err


def unavailable_error(
    ctx: RoundContext,
    target: str,
    attempts: int,
    elapsed_s: float,
    last: status_pb2.Status,
) -> CoordinatorUnavailableError:
    """The error after the retry budget ran out against an unavailable coordinator."""
    return ctx.error(
        CoordinatorUnavailableError,
        f"the coordinator at {target} is unavailable; gave up after "
        f"{attempts} attempt{'s' if attempts != 1 else ''} over {elapsed_s:.1f} s "
        f"(last error: {code_pb2.Code.Name(last.code)}: {last.message or 'no details'})",
    )


def deadline_error(ctx: RoundContext, target: str, timeout_s: float) -> CoordinatorUnavailableError:
    """The error when the coordinator did not answer within the call deadline."""
    return ctx.error(
        CoordinatorUnavailableError,
        f"no answer from the coordinator at {target} within the "
        f"call timeout of {timeout_s:g} s (ClientSettings.call_timeout_s); keep it above "
        "the coordinator's round timeout so missing ranks are reported by name",
    )


def closed_error(
    job: str, group: str, rank: int, step: int | None, *, while_waiting: bool
) -> ClientClosedError:
    """The error for using (or closing under a call of) a closed client."""
    client = f"the client for job {job!r} rank {rank}"
    if step is None:
        sentence = f"Cannot open {client}: it has been closed."
    elif while_waiting:
        sentence = f"Step {step} was abandoned: {client} was closed while waiting for the round."
    else:
        sentence = f"Cannot reduce step {step}: {client} has been closed."
    return ClientClosedError(sentence, job=job, group=group, step=step, rank=rank)
