"""The reduction coordinator: a pure round table behind a thin grpc.aio servicer.

- :class:`RoundTable` (``round_table``) is the state machine of rounds, with no
  gRPC in it; :class:`Outcome` and friends (``outcomes``) are what it answers.
- ``servicer`` maps the v2 protos onto table calls; ``metrics`` observes the
  table for Prometheus; ``app`` runs it all (:func:`serve`,
  :class:`CoordinatorThread`); ``cli`` and ``status_cli`` are ``lossreduce
  serve`` and ``lossreduce status``.
"""

from .app import SERVICE_NAME, Coordinator, CoordinatorThread, serve, start
from .metrics import CoordinatorMetrics
from .outcomes import (
    Outcome,
    OutcomeKind,
    OutcomeStore,
    RejectReason,
    RoundKey,
    RoundObserver,
    TermNormalizerValue,
)
from .round_table import Admission, Contribution, Round, RoundTable
from .servicer import CoordinatorServicer
from .settings import CoordinatorSettings

__all__ = [
    "SERVICE_NAME",
    "Admission",
    "Contribution",
    "Coordinator",
    "CoordinatorMetrics",
    "CoordinatorServicer",
    "CoordinatorSettings",
    "CoordinatorThread",
    "Outcome",
    "OutcomeKind",
    "OutcomeStore",
    "RejectReason",
    "Round",
    "RoundKey",
    "RoundObserver",
    "RoundTable",
    "TermNormalizerValue",
    "serve",
    "start",
]
