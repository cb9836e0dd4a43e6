"""The reduction coordinator: a pure round table behind a thin grpc.aio servicer.

- :class:`RoundTable` (``round_table``) is the state machine of rounds, with no
  gRPC in it; :class:`Outcome` and friends (``outcomes``) are what it answers.
  Its parts: ``validation`` (a contribution alone and against its round's
  contract), ``summation`` (exact sums, aggregates' expansions included),
  ``records`` (what a restarted coordinator keeps of a round),
  ``step_window`` (a group's live and finished rounds, and its stale steps),
  ``rounds`` (a round and an admission), ``refusals`` (why a request is
  refused before any round) and ``run_claims`` (which run holds each job and
  group).
- ``servicer`` maps the v2 protos onto table calls; ``metrics`` observes the
  table for Prometheus; ``app`` runs it all (:func:`serve`,
  :class:`CoordinatorThread`); ``cli`` is ``lossreduce serve`` (``lossreduce
  status`` dials the coordinator, so it lives in :mod:`lossreduce.client`).
- Reliability and security (``docs/guarantees.md``): ``journal`` and
  ``journal_store`` persist finished rounds before they are answered; ``auth``
  checks bearer tokens and job scopes; ``security`` holds TLS and the binding
  rule; ``limits`` and ``wire_guard`` refuse over-long names and undecodable
  bytes; ``hardening`` assembles them from the settings.
- ``bench`` is ``lossreduce bench`` (``docs/performance.md``); nothing here
  imports it. The node-local aggregator that feeds hierarchical rounds dials
  the coordinator, so it lives in :mod:`lossreduce.client`.
"""

from .app import SERVICE_NAME, Coordinator, CoordinatorThread, serve, start
from .auth import BearerTokenInterceptor, TokenFileError, TokenGrant, TokenRegistry, load_tokens
from .journal import JournalError, JournalRecord, JournalSettings, RoundJournal
from .journal_store import JournalOutcomeStore
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
from .security import InsecureBindingError, TlsConfigError
from .servicer import CoordinatorServicer
from .settings import CoordinatorSettings

__all__ = [
    "SERVICE_NAME",
    "Admission",
    "BearerTokenInterceptor",
    "Contribution",
    "Coordinator",
    "CoordinatorMetrics",
    "CoordinatorServicer",
    "CoordinatorSettings",
    "CoordinatorThread",
    "InsecureBindingError",
    "JournalError",
    "JournalOutcomeStore",
    "JournalRecord",
    "JournalSettings",
    "Outcome",
    "OutcomeKind",
    "OutcomeStore",
    "RejectReason",
    "Round",
    "RoundJournal",
    "RoundKey",
    "RoundObserver",
    "RoundTable",
    "TermNormalizerValue",
    "TlsConfigError",
    "TokenFileError",
    "TokenGrant",
    "TokenRegistry",
    "load_tokens",
    "serve",
    "start",
]
