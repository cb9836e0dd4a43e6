"""The wire encoding of :mod:`lossreduce.errors`: an exception <-> ``google.rpc.Status``.

Over gRPC each :class:`~lossreduce.errors.LossReduceError` travels as a
``google.rpc.Status`` whose code is fixed per class and whose details hold one
``google.rpc.ErrorInfo`` (domain :data:`ERROR_DOMAIN`, the class's ``reason``,
and the error's context as metadata). :func:`to_status` and
:func:`from_status` are the two directions of that mapping and the only place
it is written; values travel as ``repr`` of the double, so every one
(including ``nan`` and ``inf``) comes back bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from lossreduce.errors import (
    AuthenticationError,
    ConflictingContributionError,
    CoordinatorUnavailableError,
    InvalidPartialError,
    LimitExceededError,
    LossReduceError,
    RoundAbortedError,
    RunConflictError,
)

__all__ = ["ERROR_DOMAIN", "from_status", "to_status"]

ERROR_DOMAIN = "lossreduce.v2"
"""``ErrorInfo.domain`` of every error the coordinator sends."""

_LIST_SEP = ","


def _tree(cls: type[LossReduceError]) -> Iterator[type[LossReduceError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _tree(sub)


# Every class of the tree that names its own reason decodes to itself; a subclass
# defined elsewhere that inherits a reason must not capture its parent's.
_BY_REASON: dict[str, type[LossReduceError]] = {
    cls.reason: cls
    for cls in _tree(LossReduceError)
    if "reason" in vars(cls) and cls.__module__ == LossReduceError.__module__
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
    """A metadata value: ``repr`` round-trips every double exactly, including nan and inf."""
    return repr(float(value))


def _parse_value(text: str) -> float:
    """The inverse of :func:`_format_value`."""
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
    if err.run:
        metadata["run"] = err.run
    if isinstance(err, RunConflictError):
        metadata["holder"] = err.holder
        if err.held_since is not None:
            metadata["held_since"] = _format_value(err.held_since)
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
    err = cls(
        status.message,
        job=meta.get("job", job),
        group=meta.get("group", group),
        step=int(meta["step"]) if "step" in meta else step,
        rank=int(meta["rank"]) if "rank" in meta else rank,
        terms=_split(meta.get("terms", "")),
        values=[_parse_value(v) for v in _split(meta.get("values", ""))],
        ranks=[int(r) for r in _split(meta.get("ranks", ""))],
        limit=meta.get("limit", ""),
        run=meta.get("run", ""),
    )
    if isinstance(err, RunConflictError):
        err.holder = meta.get("holder", "")
        err.held_since = _parse_value(meta["held_since"]) if "held_since" in meta else None
    return err
