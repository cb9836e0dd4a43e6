"""The engine-side client of the reduction coordinator.

Each trainer rank sends its per-term partial normalizers for a step and gets
back the global normalizers — the same on every rank — or one of the typed
errors of :mod:`lossreduce.errors` (re-exported here; the tree, with the
status code each class travels as, is drawn at the top of that module). From
the client's side: a failed round raises a :class:`ReductionError` subclass on
every rank (no rank may run backward); :class:`CoordinatorUnavailableError`
means the retry budget ran out or the call deadline passed;
:class:`ClientClosedError` means the client was used after ``close()``.

:class:`ReductionClient` blocks; :class:`AsyncReductionClient` is its asyncio
twin and the one implementation of both.
"""

from lossreduce.client._wire import PartialValue, RoundResult, SupportsItem
from lossreduce.client.aio import AsyncReductionClient, ClientState
from lossreduce.client.retry import Backoff
from lossreduce.client.settings import BASE_CHANNEL_OPTIONS, ClientSettings, channel_options
from lossreduce.client.sync import ReductionClient
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
    StaleRoundError,
)

__all__ = [
    "BASE_CHANNEL_OPTIONS",
    "AsyncReductionClient",
    "AuthenticationError",
    "Backoff",
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
    "ReductionClient",
    "ReductionError",
    "RoundAbortedError",
    "RoundResult",
    "RoundTimeoutError",
    "StaleRoundError",
    "SupportsItem",
    "channel_options",
]
