"""The one exception hierarchy of lossreduce.

Every way of reducing a global normalizer (the coordinator over gRPC, a
torch.distributed all-reduce, one local process) raises these same types, so
engine code handles failures once. Each class fixes the ``google.rpc.Code``
and ``ErrorInfo.reason`` it travels as over gRPC; the encoding itself
(``to_status``/``from_status``) is :mod:`lossreduce.status_codec`.

::

    LossReduceError                       any failure; carries job, group, step, rank
    ├── ReductionError                    the round produced no normalizers
    │   ├── InvalidPartialError           INVALID_ARGUMENT  this rank sent a bad partial/request
    │   ├── EmptyNormalizerError          FAILED_PRECONDITION  a global normalizer is <= 0 or not finite
    │   ├── ContractMismatchError         FAILED_PRECONDITION  ranks disagree (world size, terms, contracts)
    │   ├── StaleRoundError               FAILED_PRECONDITION  step older than the retained window
    │   ├── RunConflictError              FAILED_PRECONDITION  another run holds the job and group
    │   ├── RoundAbortedError             ABORTED  a peer failed; ``culprit_rank`` names it
    │   │   └── RoundTimeoutError         ABORTED  ranks missing at the round timeout; ``missing_ranks``
    │   ├── ConflictingContributionError  ALREADY_EXISTS  a different contribution for the same round
    │   └── LimitExceededError            RESOURCE_EXHAUSTED  a coordinator limit; ``limit`` names it
    ├── CoordinatorUnavailableError       UNAVAILABLE / DEADLINE_EXCEEDED (after retries) / shutdown
    ├── AuthenticationError               UNAUTHENTICATED / PERMISSION_DENIED
    ├── ClientClosedError                 the client was used after ``close()``
    ├── ReductionConfigError              (also ValueError; local) a bad reduction, term, engine
    │                                     or microbatch setting
    ├── ReductionInputError               (also ValueError; local) a malformed batch or loss:
    │   │                                 shapes, masks, cu_seqlens, group sizes, terms returned
    │   └── InconsistentNormalizerError   a mean term's local mean x normalizer is not its sum
    └── UsageError                        (also ValueError; local) a client or backend used in a
                                          way it cannot serve: step, rank or world size out of
                                          range, a second event loop, no process group
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from google.rpc import code_pb2

__all__ = [
    "AuthenticationError",
    "ClientClosedError",
    "ConflictingContributionError",
    "ContractMismatchError",
    "CoordinatorUnavailableError",
    "EmptyNormalizerError",
    "InconsistentNormalizerError",
    "InvalidPartialError",
    "LimitExceededError",
    "LossReduceError",
    "RankContext",
    "ReductionConfigError",
    "ReductionError",
    "ReductionInputError",
    "RoundAbortedError",
    "RoundTimeoutError",
    "RunConflictError",
    "StaleRoundError",
    "UsageError",
    "describe_round",
    "format_terms",
    "round_error",
]


class LossReduceError(Exception):
    """Base of every lossreduce error.

    Attributes name where it happened: ``job``, ``group``, ``step``, ``run``
    (the run the request named; empty when none) and ``rank``, the rank that
    received the error: on a client or a normalizer
    backend always the rank it serves (rank 0 in a single process), for a
    round's shared error too, whose culprit or missing ranks are in ``ranks``.
    ``rank`` is ``None`` only where no rank is known: a round's error as the
    coordinator builds it once for every rank (each client fills in its own on
    receipt), or a usage error raised before any rank was given. Then what is
    wrong: ``terms`` and their ``values``, other ``ranks`` involved, and for
    some subclasses a ``limit``. ``str(err)`` is the full human-readable
    message, which already names all of these.
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
        run: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.job = job
        self.group = group
        self.step = step
        self.rank = rank
        self.run = run
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
            "run": self.run,
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


class RunConflictError(ReductionError):
    """Another run holds the round's job and group: two launches named one job (a
    second run of the same script, two users keeping a default job), or this run
    was replaced by a resumed one. Refused before any answer, on every rank of the
    refused run. ``run`` is the refused run, ``holder`` the run holding the claim
    and ``held_since`` when it claimed it (Unix seconds); the message says what to
    change."""

    code = code_pb2.FAILED_PRECONDITION
    reason = "RUN_CONFLICT"

    def __init__(
        self,
        message: str,
        *,
        holder: str = "",
        held_since: float | None = None,
        job: str = "",
        group: str = "",
        step: int | None = None,
        rank: int | None = None,
        terms: Sequence[str] = (),
        values: Sequence[float] = (),
        ranks: Sequence[int] = (),
        limit: str = "",
        run: str = "",
    ) -> None:
        super().__init__(
            message,
            job=job,
            group=group,
            step=step,
            rank=rank,
            terms=terms,
            values=values,
            ranks=ranks,
            limit=limit,
            run=run,
        )
        self.holder = holder
        self.held_since = held_since

    def _fields(self) -> dict[str, object]:
        return {**super()._fields(), "holder": self.holder, "held_since": self.held_since}


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


class ReductionConfigError(LossReduceError, ValueError):
    """A reduction library setting is invalid: a policy-gradient mode or
    divisor, a loss term's name, kind or contract, an engine option, a
    microbatch setting. Raised locally, before any round; also a
    :class:`ValueError`, so ``except ValueError`` callers keep working."""

    code = code_pb2.INVALID_ARGUMENT
    reason = "INVALID_REDUCTION_CONFIG"


class ReductionInputError(LossReduceError, ValueError):
    """A batch or loss handed to the reduction library is malformed:
    mismatched shapes, bad ``cu_seqlens`` or group sizes, a loss mask outside
    its denominator mask, a ``loss_fn`` returning the wrong terms. Raised
    locally, before any round; also a :class:`ValueError`."""

    code = code_pb2.INVALID_ARGUMENT
    reason = "INVALID_REDUCTION_INPUT"


class UsageError(LossReduceError, ValueError):
    """A client or normalizer backend was used in a way it cannot serve: a
    step, rank or world size the wire cannot carry, an unreadable TLS file,
    a client called from a second event loop, a torch.distributed backend
    without a process group. Raised locally; nothing was sent. Also a
    :class:`ValueError`."""

    code = code_pb2.FAILED_PRECONDITION
    reason = "USAGE"


class InconsistentNormalizerError(ReductionInputError):
    """A mean term's local mean times its local normalizer is not its local sum:
    the loss and its normalizer count different units, e.g. different masks
    (the reduction library's debug check). Raised locally, before any round;
    also a :class:`ValueError`."""

    reason = "INCONSISTENT_NORMALIZER"


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
