"""The engine-side client of the reduction coordinator.

Each trainer rank sends its per-term partial normalizers for a step and gets
back the global normalizers — the same on every rank — or one of the typed
errors of :mod:`lossreduce.errors`, re-exported here::

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
    ├── CoordinatorUnavailableError       UNAVAILABLE after the retry budget, or no answer in the deadline
    ├── AuthenticationError               UNAUTHENTICATED / PERMISSION_DENIED
    └── ClientClosedError                 the client was used after ``close()``

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
