"""The engine-side client of the reduction coordinator.

Each trainer rank sends its per-term partial normalizers for a step and gets
back the global normalizers — the same on every rank — or one of the typed
errors of :mod:`lossreduce.errors` (those a client raises are re-exported
here; the tree, with the status code each class travels as, is drawn at the
top of that module). Every error a client raises carries this client's job,
group and step, and its own rank as ``rank`` (the culprit of a failed round,
if any, is in ``ranks``). From
the client's side: a failed round raises a :class:`ReductionError` subclass on
every rank (no rank may run backward); :class:`CoordinatorUnavailableError`
means the retry budget ran out or the call deadline passed;
:class:`ClientClosedError` means the client was used after ``close()``;
:class:`UsageError` (also a ``ValueError``) means an argument or the calling
event loop cannot be served, and nothing was sent.

:class:`ReductionClient` blocks; :class:`AsyncReductionClient` is its asyncio
twin and the one implementation of both. ``reduce_start`` sends a round without
waiting for it (a :class:`PendingReduction`, or an asyncio task).
"""

from lossreduce.client.aio import AsyncReductionClient, ClientState
from lossreduce.client.pending import PendingReduction
from lossreduce.client.settings import ClientSettings, channel_options
from lossreduce.client.sync import ReductionClient
from lossreduce.client.types import PartialValue, RoundResult
from lossreduce.errors import (
    AuthenticationError,
    ClientClosedError,
    ConflictingContributionError,
    ContractMismatchError,
    CoordinatorUnavailableError,
    EmptyNormalizerError,
    InvalidPartialError,
    LimitExceededError,
    LossReduceError,
    ReductionError,
    RoundAbortedError,
    RoundTimeoutError,
    RunConflictError,
    StaleRoundError,
    UsageError,
)

__all__ = [
    "AsyncReductionClient",
    "AuthenticationError",
    "ClientClosedError",
    "ClientSettings",
    "ClientState",
    "ConflictingContributionError",
    "ContractMismatchError",
    "CoordinatorUnavailableError",
    "EmptyNormalizerError",
    "InvalidPartialError",
    "LimitExceededError",
    "LossReduceError",
    "PartialValue",
    "PendingReduction",
    "ReductionClient",
    "ReductionError",
    "RoundAbortedError",
    "RoundResult",
    "RoundTimeoutError",
    "RunConflictError",
    "StaleRoundError",
    "UsageError",
    "channel_options",
]
