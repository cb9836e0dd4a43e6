"""The one exception hierarchy of lossreduce, and its wire encoding.

Every way of reducing a global normalizer (the coordinator over gRPC, a
torch.distributed all-reduce, one local process) raises these same types, so
engine code handles failures once. Over gRPC each exception travels as a
``google.rpc.Status`` whose code is fixed per class and whose details hold one
``google.rpc.ErrorInfo`` (domain ``lossreduce.v2``); :func:`to_status` and
:func:`from_status` are the two directions of that mapping and the only place
it is written.

::

    LossReduceError                       any failure; carries job, group, step, rank
    ├── ReductionError                    the round produced no normalizers
    │   ├── InvalidPartialError           INVALID_ARGUMENT  this rank sent a bad partial/request
    │   ├── EmptyNormalizerError          FAILED_PRECONDITION  a global normalizer is <= 0 or not finite
    │   ├── ContractMismatchError         FAILED_PRECONDITION  ranks disagree (world size, terms, contracts)
    │   ├── StaleRoundError               FAILED_PRECONDITION  step older than the retained window
    │   ├── RoundAbortedError             ABORTED  a peer failed; ``culprit_rank`` names it
    │   │   └── RoundTimeoutError         ABORTED  ranks missing at the round timeout; ``missing_ranks``
    │   ├── ConflictingContributionError  ALREADY_EXISTS  a different contribution for the same round
    │   └── LimitExceededError            RESOURCE_EXHAUSTED  a coordinator limit; ``limit`` names it
    ├── CoordinatorUnavailableError       UNAVAILABLE / DEADLINE_EXCEEDED (after retries) / shutdown
    ├── AuthenticationError               UNAUTHENTICATED / PERMISSION_DENIED
    └── ClientClosedError                 the client was used after ``close()``
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

__all__ = [
    "ERROR_DOMAIN",
    "AuthenticationError",
    "ClientClosedError",
    "ConflictingContributionError",
    "ContractMismatchError",
    "CoordinatorUnavailableError",
    "EmptyNormalizerError",
    "InvalidPartialError",
    "LimitExceededError",
    "LossReduceError",
    "RankContext",
    "ReductionError",
    "RoundAbortedError",
    "RoundTimeoutError",
    "StaleRoundError",
    "describe_round",
    "format_terms",
    "from_status",
    "round_error",
    "to_status",
]

ERROR_DOMAIN = "lossreduce.v2"
"""``ErrorInfo.domain`` of every error the coordinator sends."""

_LIST_SEP = ","


class LossReduceError(Exception):
    """Base of every lossreduce error.

    Attributes name where it happened: ``job``, ``group``, ``step`` and the
    ``rank`` that raised it (``None`` where not known, e.g. in a single process),
    plus what is wrong: ``terms`` and their ``values``, other ``ranks``
    involved, and for some subclasses a ``limit``. ``str(err)`` is the full
    human-readable message, which already names all of these.
    """

    code: ClassVar[int] = code_pb2.UNKNOWN
    """The ``google.rpc.Code`` this error travels as."""
    reason: ClassVar[str] = "UNKNOWN"
    """The ``ErrorInfo.reason`` this error travels as (unique per class)."""

    def __init__(
        self,
        message: str,
        *,
        job: str = "",
        group: str = "",
        step: int | None = None,
        rank: int | None = None,
        terms: Sequence[str] = (),
        values: Sequence[float] = (),
        ranks: Sequence[int] = (),
        limit: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.job = job
        self.group = group
        self.step = step
        self.rank = rank
        self.terms: tuple[str, ...] = tuple(terms)
        self.values: tuple[float, ...] = tuple(values)
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.limit = limit

    def __reduce__(self) -> tuple[object, ...]:
        # Keep keyword context across pickling (Ray ships exceptions between processes).
        return (_rebuild, (type(self), self.message, self._fields()))

    def _fields(self) -> dict[str, object]:
        return {
            "job": self.job,
            "group": self.group,
            "step": self.step,
            "rank": self.rank,
            "terms": self.terms,
            "values": self.values,
            "ranks": self.ranks,
            "limit": self.limit,
        }


def _rebuild(
    cls: type[LossReduceError], message: str, fields: dict[str, object]
) -> LossReduceError:
    err = cls.__new__(cls)
    LossReduceError.__init__(err, message)
    for key, value in fields.items():
        setattr(err, key, value)
    return err


class ReductionError(LossReduceError):
    """The round produced no normalizers; no rank may run backward for it."""


class InvalidPartialError(ReductionError):
    """This rank sent something invalid: a NaN, infinite or negative partial, a
    rank outside the world, duplicate or malformed term names. ``terms`` and
    ``values`` name what was rejected."""

    code = code_pb2.INVALID_ARGUMENT
    reason = "INVALID_PARTIAL"


class EmptyNormalizerError(ReductionError):
    """A global normalizer is zero, negative or not finite (e.g. no active token
    on any rank). ``terms``/``values`` list every bad term and its value."""

    code = code_pb2.FAILED_PRECONDITION
    reason = "EMPTY_NORMALIZER"


class ContractMismatchError(ReductionError):
    """Ranks of one round disagree on world size, term names or a term's
    contract. ``ranks`` names the disagreeing ranks."""

    code = code_pb2.FAILED_PRECONDITION
    reason = "CONTRACT_MISMATCH"


class StaleRoundError(ReductionError):
    """The step is older than the coordinator's retained window for the group."""

    code = code_pb2.FAILED_PRECONDITION
    reason = "STALE_ROUND"


class RoundAbortedError(ReductionError):
    """Another rank's contribution was invalid, so the round was aborted for
    everyone. ``culprit_rank`` (``ranks[0]``) names it."""

    code = code_pb2.ABORTED
    reason = "PEER_INVALID"

    @property
    def culprit_rank(self) -> int | None:
        return self.ranks[0] if self.ranks else None


class RoundTimeoutError(RoundAbortedError):
    """Not every rank arrived within the round timeout. ``missing_ranks`` names
    every rank that never contributed."""

    reason = "ROUND_TIMEOUT"

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return self.ranks


class ConflictingContributionError(ReductionError):
    """This rank already contributed different values to the same round; the
    round keeps the first contribution."""

    code = code_pb2.ALREADY_EXISTS
    reason = "CONFLICTING_CONTRIBUTION"


class LimitExceededError(ReductionError):
    """A coordinator limit was hit (rounds in flight, groups, terms, world
    size, message size). ``limit`` names the setting."""

    code = code_pb2.RESOURCE_EXHAUSTED
    reason = "LIMIT_EXCEEDED"


class CoordinatorUnavailableError(LossReduceError):
    """The coordinator could not be reached within the retry budget, is
    shutting down, or did not answer within the call's deadline."""

    code = code_pb2.UNAVAILABLE
    reason = "UNAVAILABLE"


class AuthenticationError(LossReduceError):
    """The coordinator refused the credentials (missing or wrong token, or a
    token not scoped to this job)."""

    code = code_pb2.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class ClientClosedError(LossReduceError):
    """The client was used after it was closed."""

    code = code_pb2.FAILED_PRECONDITION
    reason = "CLIENT_CLOSED"


_BY_REASON: dict[str, type[LossReduceError]] = {
    cls.reason: cls
    for cls in (
        InvalidPartialError,
        EmptyNormalizerError,
        ContractMismatchError,
        StaleRoundError,
        RoundAbortedError,
        RoundTimeoutError,
        ConflictingContributionError,
        LimitExceededError,
        CoordinatorUnavailableError,
        AuthenticationError,
    )
}

# Status codes that can arrive without lossreduce details (from gRPC itself or
# an interceptor) and the class each maps onto.
_BY_CODE: dict[int, type[LossReduceError]] = {
    code_pb2.INVALID_ARGUMENT: InvalidPartialError,
    code_pb2.ABORTED: RoundAbortedError,
    code_pb2.ALREADY_EXISTS: ConflictingContributionError,
    code_pb2.RESOURCE_EXHAUSTED: LimitExceededError,
    code_pb2.UNAVAILABLE: CoordinatorUnavailableError,
    code_pb2.DEADLINE_EXCEEDED: CoordinatorUnavailableError,
    code_pb2.CANCELLED: CoordinatorUnavailableError,
    code_pb2.UNAUTHENTICATED: AuthenticationError,
    code_pb2.PERMISSION_DENIED: AuthenticationError,
}


def _format_value(value: float) -> str:
    # repr round-trips every double exactly, including nan and inf.
    return repr(float(value))


def _parse_value(text: str) -> float:
    return float(text)


def to_status(err: LossReduceError) -> status_pb2.Status:
    """Encode ``err`` as the ``google.rpc.Status`` the coordinator sends."""
    metadata: dict[str, str] = {"job": err.job, "group": err.group}
    if err.step is not None:
        metadata["step"] = str(err.step)
    if err.rank is not None:
        metadata["rank"] = str(err.rank)
    if err.terms:
        metadata["terms"] = _LIST_SEP.join(err.terms)
    if err.values:
        metadata["values"] = _LIST_SEP.join(_format_value(v) for v in err.values)
    if err.ranks:
        metadata["ranks"] = _LIST_SEP.join(str(r) for r in err.ranks)
    if err.limit:
        metadata["limit"] = err.limit
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=err.code, message=err.message, details=[detail])


def _split(text: str) -> list[str]:
    return [part for part in text.split(_LIST_SEP) if part]


def from_status(
    status: status_pb2.Status,
    *,
    job: str = "",
    group: str = "",
    step: int | None = None,
    rank: int | None = None,
) -> LossReduceError:
    """Decode a ``google.rpc.Status`` into the matching exception.

    Context missing from the details (a status raised by gRPC itself) is
    filled from the keyword arguments, which the client knows from its call.
    """
    info: error_details_pb2.ErrorInfo | None = None
    for detail in status.details:
        candidate = error_details_pb2.ErrorInfo()
        if detail.Unpack(candidate) and candidate.domain == ERROR_DOMAIN:
            info = candidate
            break
    if info is None:
        cls = _BY_CODE.get(status.code, LossReduceError)
        return cls(
            status.message or code_pb2.Code.Name(status.code),
            job=job,
            group=group,
            step=step,
            rank=rank,
        )
    cls = _BY_REASON.get(info.reason) or _BY_CODE.get(status.code, LossReduceError)
    meta: Mapping[str, str] = info.metadata
    return cls(
        status.message,
        job=meta.get("job", job),
        group=meta.get("group", group),
        step=int(meta["step"]) if "step" in meta else step,
        rank=int(meta["rank"]) if "rank" in meta else rank,
        terms=_split(meta.get("terms", "")),
        values=[_parse_value(v) for v in _split(meta.get("values", ""))],
        ranks=[int(r) for r in _split(meta.get("ranks", ""))],
        limit=meta.get("limit", ""),
    )


_E = TypeVar("_E", bound=LossReduceError)


def round_error(
    cls: type[_E],
    detail: str,
    *,
    job: str,
    group: str,
    step: int | None,
    rank: int | None = None,
    name_rank: bool = False,
    terms: Sequence[str] = (),
    values: Sequence[float] = (),
    ranks: Sequence[int] = (),
    limit: str = "",
) -> _E:
    """A ``cls`` about one round whose message starts by naming it.

    ``"job 'j' group 'g' step 7: <detail>"``, or with ``name_rank``
    ``"job 'j' group 'g' step 7 rank 1: <detail>"`` for errors that belong to
    one rank (a round's shared error must not name the rank receiving it).
    """
    where = describe_round(job, group, step)
    if name_rank and rank is not None:
        where = f"{where} rank {rank}"
    return cls(
        f"{where}: {detail}",
        job=job,
        group=group,
        step=step,
        rank=rank,
        terms=terms,
        values=values,
        ranks=ranks,
        limit=limit,
    )


@dataclass(frozen=True)
class RankContext:
    """One rank's place in one round; every error it builds names all of it."""

    job: str
    group: str
    step: int
    rank: int

    def describe(self) -> str:
        """``job 'j' group 'g' step 7 rank 1``."""
        return f"{describe_round(self.job, self.group, self.step)} rank {self.rank}"

    def error(
        self,
        cls: type[_E],
        detail: str,
        *,
        terms: Sequence[str] = (),
        values: Sequence[float] = (),
        ranks: Sequence[int] = (),
    ) -> _E:
        """A ``cls`` whose message is ``"<describe()>: <detail>"``, carrying this context."""
        return round_error(
            cls,
            detail,
            job=self.job,
            group=self.group,
            step=self.step,
            rank=self.rank,
            name_rank=True,
            terms=terms,
            values=values,
            ranks=ranks,
        )


def describe_round(job: str, group: str, step: int | None) -> str:
    """``job 'j' group 'g' step 7``: the prefix every message starts with."""
    where = f"job {job!r} group {group!r}"
    return where if step is None else f"{where} step {step}"


def format_terms(terms: Sequence[str], values: Sequence[float]) -> str:
    """``'tokens'=0.0, 'groups'=nan``: terms with their values for messages."""
    return ", ".join(
        f"{t!r}={v!r}" if not math.isnan(v) else f"{t!r}=nan"
        for t, v in zip(terms, values, strict=True)
    )
