"""Turn the security and journal settings into the pieces :func:`lossreduce.server.start` uses.

The malformed-request guard (:mod:`lossreduce.server.wire_guard`) is always
on; the token interceptor, TLS and the journal follow the settings.

One place reads ``token_file``/``token``, ``tls_*``, ``insecure`` and
``journal*`` from :class:`CoordinatorSettings`, checks them together (the
binding rule needs to know about tokens and TLS at once) and hands back the
interceptor, the server credentials and the opened journal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from .auth import BearerTokenInterceptor, TokenFileError, load_tokens
from .journal import JournalError, JournalSettings, RoundJournal
from .journal_store import JournalOutcomeStore
from .outcomes import OutcomeStore
from .run_claims import ClaimStore
from .security import (
    InsecureBindingError,
    TlsConfigError,
    TlsFiles,
    check_binding,
    server_credentials,
)
from .settings import CoordinatorSettings
from .wire_guard import MalformedRequestInterceptor

__all__ = ["CONFIG_ERRORS", "Hardening", "harden"]

_log = logging.getLogger(__name__)

CONFIG_ERRORS: tuple[type[Exception], ...] = (
    TokenFileError,
    TlsConfigError,
    InsecureBindingError,
    JournalError,
)
"""What :func:`harden` raises for bad settings; ``lossreduce serve`` prints them as one line."""


@dataclass
class Hardening:
    """Interceptors, credentials and journal of one coordinator; :meth:`close` at stop."""

    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    credentials: grpc.ServerCredentials | None = None
    store: OutcomeStore | None = None
    journal: RoundJournal | None = field(default=None)
    claim_store: ClaimStore | None = None
    """The journal's claims, so a restarted coordinator knows which run holds each group."""

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def harden(settings: CoordinatorSettings, *, store: OutcomeStore | None = None) -> Hardening:
    """Validate the security settings and open the journal.

    ``store`` (a caller's own outcome store) takes the place of the journal.
    Raises one of :data:`CONFIG_ERRORS` with a message naming the flag or file.
    """
    tls = TlsFiles.load(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    env_token = settings.token.get_secret_value() if settings.token is not None else None
    registry = load_tokens(settings.token_file, env_token)
    check_binding(
        settings.host,
        settings.port,
        token=registry is not None,
        tls=tls is not None,
        insecure=settings.insecure,
    )
    # The guard runs first, so the token check only ever sees parsed requests.
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (MalformedRequestInterceptor(),)
    if registry is not None:
        interceptors += (BearerTokenInterceptor(registry),)
    hardening = Hardening(
        interceptors=interceptors,
        credentials=None if tls is None else server_credentials(tls),
        store=store,
    )
    if store is None and settings.journal is not None:
        journal = RoundJournal(
            JournalSettings(
                path=settings.journal,
                synchronous=settings.journal_sync,
                retain_rounds_per_group=settings.journal_retain_rounds,
                retain_seconds=settings.journal_retain_s,
            )
        ).open()
        hardening.journal = journal
        hardening.store = hardening.claim_store = JournalOutcomeStore(journal)
    _log.info(
        "coordinator protection: %s, %s, journal %s",
        "no token" if registry is None else f"{len(registry)} bearer tokens",
        "no TLS" if tls is None else ("mutual TLS" if tls.client_ca else "TLS"),
        settings.journal if hardening.journal is not None else "off",
    )
    return hardening
