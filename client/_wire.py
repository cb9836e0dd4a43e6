"""The pure part of the client: requests in, results or typed errors out.

No gRPC and no event loop here, so every conversion (numbers and 0-d tensors to
doubles, responses to :class:`RoundResult`, statuses to exceptions carrying the
client's own job, group, step and rank) is unit-testable alone.

Local checks are deliberately few. A NaN, infinite or negative partial, a bad
term name or a rank outside the world is *sent anyway*: the coordinator then
answers this rank with :class:`InvalidPartialError` and every peer with
:class:`RoundAbortedError` naming this rank, at once. Rejecting it here would
leave the peers waiting for the round timeout. Only what cannot be encoded at
all (a value that is not a number, a tensor with more than one element, a
contract for a term that has no partial) is rejected before sending.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from google.rpc import code_pb2, status_pb2

from lossreduce.errors import (
    ClientClosedError,
    CoordinatorUnavailableError,
    InvalidPartialError,
    LossReduceError,
    RankContext,
    describe_round,
    from_status,
)
from lossreduce.v2 import coordinator_pb2 as pb

__all__ = [
    "PartialValue",
    "RoundContext",
    "RoundResult",
    "SupportsItem",
    "build_request",
    "closed_error",
    "coerce_partial",
    "deadline_error",
    "decode_status",
    "parse_response",
    "unavailable_error",
]


@runtime_checkable
class SupportsItem(Protocol):
    """A scalar container such as a 0-d ``torch.Tensor`` or a numpy scalar."""

    def item(self) -> float | int: ...


PartialValue: TypeAlias = float | int | SupportsItem
"""What ``reduce`` accepts as a partial: a Python number or a 0-d tensor."""


@dataclass(frozen=True)
class RoundContext(RankContext):
    """Where a call happens; every error the client raises names all of it."""

    world_size: int


@dataclass(frozen=True)
class RoundResult:
    """The answer to one round: the same for every rank of the round.

    ``normalizers`` maps each term to its global normalizer (finite and > 0),
    in the order the terms were sent; ``zero_ranks`` maps each term to how many
    ranks sent a partial of 0 for it (ranks with no active unit locally).
    """

    step: int
    normalizers: Mapping[str, float]
    zero_ranks: Mapping[str, int]


def coerce_partial(term: str, value: object, ctx: RoundContext) -> float:
    """``value`` as a double, or InvalidPartialError when it cannot be one.

    Accepts ints and floats and anything with ``.item()`` and no dimensions
    (0-d torch tensors, numpy scalars), without importing torch.
    """
    if isinstance(value, bool):
        raise _not_a_number(term, value, ctx, "a bool is not a partial normalizer")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, SupportsItem):
        ndim = getattr(value, "ndim", 0)
        if ndim != 0:
            shape = tuple(getattr(value, "shape", ()))
            raise _not_a_number(
                term, value, ctx, f"a partial must be a 0-d tensor, got shape {list(shape)}"
            )
        item = value.item()
        if isinstance(item, int | float) and not isinstance(item, bool):
            return float(item)
    raise _not_a_number(term, value, ctx, f"got {type(value).__name__}")


def _not_a_number(term: str, value: object, ctx: RoundContext, why: str) -> InvalidPartialError:
    return ctx.error(
        InvalidPartialError,
        f"partial for term {term!r} is not a number ({why}); "
        "nothing was sent, so peers will see this rank missing at the round timeout",
        terms=[term],
    )


def build_request(
    ctx: RoundContext,
    partials: Mapping[str, PartialValue],
    contracts: Mapping[str, str] | None,
) -> pb.ReduceRequest:
    """The ReduceRequest for this rank's partials, terms in mapping order."""
    contracts = contracts or {}
    unknown = [term for term in contracts if term not in partials]
    if unknown:
        raise ctx.error(
            InvalidPartialError,
            f"contracts name terms {unknown} that have no partial "
            f"(terms: {list(partials)}); nothing was sent",
            terms=unknown,
        )
    return pb.ReduceRequest(
        round=pb.RoundKey(job=ctx.job, group=ctx.group, step=ctx.step),
        rank=ctx.rank,
        world_size=ctx.world_size,
        partials=[
            pb.TermPartial(
                term=term,
                value=coerce_partial(term, value, ctx),
                contract=contracts.get(term, ""),
            )
            for term, value in partials.items()
        ],
    )


def parse_response(response: pb.ReduceResponse, ctx: RoundContext) -> RoundResult:
    """The RoundResult of a successful response (``error`` unset or OK)."""
    key = response.round
    if (key.job, key.group, key.step) != (ctx.job, ctx.group, ctx.step):
        raise ctx.error(
            LossReduceError,
            f"the coordinator answered for {describe_round(key.job, key.group, key.step)} instead",
        )
    normalizers = {n.term: n.value for n in response.normalizers}
    # The coordinator validated these; a non-finite value here would silently
    # turn every scaled loss into NaN, so it is worth one cheap re-check.
    bad = {term: value for term, value in normalizers.items() if not math.isfinite(value)}
    if bad:
        raise ctx.error(
            LossReduceError,
            f"the coordinator returned non-finite normalizers {bad}",
            terms=list(bad),
            values=list(bad.values()),
        )
    return RoundResult(
        step=ctx.step,
        normalizers=normalizers,
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
    return type(err)(
        message,
        job=err.job or ctx.job,
        group=err.group or ctx.group,
        step=ctx.step if err.step is None else err.step,
        rank=ctx.rank if err.rank is None else err.rank,
        terms=err.terms,
        values=err.values,
        ranks=err.ranks,
        limit=err.limit,
    )


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
