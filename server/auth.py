"""Bearer-token authentication and per-job isolation, as a gRPC server interceptor.

Clients send ``authorization: Bearer <token>`` metadata on every call (a
stream sends it once, when it opens). Tokens come from ``--token-file`` and/or
``LOSSREDUCE_TOKEN``, both in the token-file format::

    # lossreduce tokens: one per line, optionally followed by the jobs it may use.
    # Blank lines and '#' comments are ignored.
    k3Jx0u9rVq0mXb4L2wJf7g          # any job
    Qm8Vt1yZs4Hh0cLp6nRe2a  grpo-7b,grpo-7b-eval   # only these two jobs

A token is 16 to 512 printable ASCII characters without spaces, commas or ``#``
(``secrets.token_urlsafe(24)`` makes a good one); job lists are comma
separated. ``LOSSREDUCE_TOKEN`` holds one such line.

Outcomes, each as a rich ``google.rpc.Status`` (``AuthenticationError`` on the client):

- no or malformed ``authorization`` metadata, or an unknown token: ``UNAUTHENTICATED``;
- a token scoped to other jobs: ``PERMISSION_DENIED`` naming the job it asked
  for, for ``Reduce``, ``ReduceStream`` (the stream ends at the first foreign
  request, after the answers to the requests before it), ``GetRound`` and
  ``ListRounds``; ``ListRounds`` for every job (empty ``job``) lists only the
  token's own jobs.

The health service answers without a token (probes carry none; it reveals
nothing). Tokens are compared in constant time against SHA-256 digests, and
are never logged, put in an error message or exposed as a metric: grants are
known by their position in the file (``token-file line 3``) instead.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import stat
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import code_pb2
from grpc_status import rpc_status

from lossreduce.errors import AuthenticationError
from lossreduce.status_codec import to_status
from lossreduce.v2 import coordinator_pb2 as pb

from .handler_wrap import Handler, checked, refusing, with_behavior
from .wire_guard import Undecodable

__all__ = [
    "AUTHORIZATION_HEADER",
    "BearerTokenInterceptor",
    "TokenFileError",
    "TokenGrant",
    "TokenRegistry",
    "load_tokens",
]

_log = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"
"""The metadata key carrying ``Bearer <token>`` (gRPC metadata keys are lower case)."""

_BEARER = "bearer "
MIN_TOKEN_LENGTH = 16
MAX_TOKEN_LENGTH = 512
_SERVICE = "/lossreduce.v2.ReductionCoordinator/"
_UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/",)


class TokenFileError(ValueError):
    """The token file or ``LOSSREDUCE_TOKEN`` is malformed; the message names where (never the token)."""


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """What one token may do: ``jobs`` it may use, or every job when None.

    ``source`` says where the token was defined (``token-file line 3``), for logs.
    """

    source: str
    jobs: frozenset[str] | None

    def allows(self, job: str) -> bool:
        return self.jobs is None or job in self.jobs


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _token_problem(token: str) -> str | None:
    if not MIN_TOKEN_LENGTH <= len(token) <= MAX_TOKEN_LENGTH:
        return (
            f"a token must be {MIN_TOKEN_LENGTH} to {MAX_TOKEN_LENGTH} characters long "
            f"(this one has {len(token)})"
        )
    if not all(33 <= ord(ch) <= 126 and ch not in ",#" for ch in token):
        return "a token must be printable ASCII without spaces, commas or '#'"
    return None


class TokenRegistry:
    """The accepted tokens (as digests) and their grants."""

    def __init__(self, entries: Iterable[tuple[str, TokenGrant]]) -> None:
        self._entries: list[tuple[bytes, TokenGrant]] = []
        for token, grant in entries:
            problem = _token_problem(token)
            if problem is not None:
                raise TokenFileError(f"{grant.source}: {problem}")
            digest = _digest(token)
            if any(hmac.compare_digest(digest, d) for d, _ in self._entries):
                raise TokenFileError(f"{grant.source}: the same token is defined twice")
            self._entries.append((digest, grant))
        if not self._entries:
            raise TokenFileError("no tokens defined: every call would be refused")

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TokenRegistry({len(self._entries)} tokens)"

    @classmethod
    def parse(cls, text: str, source: str) -> TokenRegistry:
        """Read the token-file format (see the module doc); ``source`` names it in errors."""
        return cls(_parse_lines(text, source))

    def authenticate(self, token: str) -> TokenGrant | None:
        """The grant of ``token``, or None. Compares against every entry in constant time."""
        digest = _digest(token)
        found: TokenGrant | None = None
        for candidate, grant in self._entries:
            # No early exit: the time taken does not depend on which entry matched.
            if hmac.compare_digest(digest, candidate):
                found = grant
        return found


def _parse_lines(text: str, source: str) -> list[tuple[str, TokenGrant]]:
    entries: list[tuple[str, TokenGrant]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        token, *rest = line.split(None, 1)
        jobs: frozenset[str] | None = None
        if rest:
            names = [name.strip() for name in rest[0].split(",")]
            if any(not name or any(ch.isspace() for ch in name) for name in names):
                raise TokenFileError(
                    f"{where}: after the token, list jobs separated by commas (got {len(names)} "
                    "entries, some empty or containing spaces)"
                )
            jobs = frozenset(names)
        entries.append((token, TokenGrant(source=where, jobs=jobs)))
    return entries


def load_tokens(token_file: Path | None, env_token: str | None) -> TokenRegistry | None:
    """The registry from ``--token-file`` and ``LOSSREDUCE_TOKEN``; None when neither is set."""
    entries: list[tuple[str, TokenGrant]] = []
    if token_file is not None:
        try:
            text = token_file.read_text(encoding="utf-8")
            mode = token_file.stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"cannot read the token file {str(token_file)!r}: {exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            _log.warning(
                "token file %s is readable by other users (mode %o); chmod 600 it",
                token_file,
                stat.S_IMODE(mode),
            )
        entries += _parse_lines(text, f"token file {str(token_file)!r}")
    if env_token:
        entries += _parse_lines(env_token, "LOSSREDUCE_TOKEN")
    if token_file is None and not env_token:
        return None
    return TokenRegistry(entries)


# -- the interceptor ---------------------------------------------------------------

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]


def _refusal(code: int, message: str, job: str = "") -> grpc.Status:
    status = to_status(AuthenticationError(message, job=job))
    # AuthenticationError travels as UNAUTHENTICATED; a known token refused a job is PERMISSION_DENIED.
    status.code = code
    return rpc_status.to_status(status)


def _presented_token(details: grpc.HandlerCallDetails) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == AUTHORIZATION_HEADER and isinstance(value, str):
            if value[: len(_BEARER)].lower() == _BEARER:
                return value[len(_BEARER) :].strip()
            return None
    return None


def _denied(grant: TokenGrant, job: str) -> grpc.Status:
    return _refusal(
        code_pb2.PERMISSION_DENIED,
        f"the bearer token ({grant.source}) may not use job {job!r}",
        job=job,
    )


def _scoped(method: str, handler: Handler, grant: TokenGrant) -> Handler:
    """``handler`` restricted to the jobs of ``grant``."""
    name = method.removeprefix(_SERVICE)

    def own_round(request: Any) -> grpc.Status | None:
        if isinstance(request, Undecodable):
            return None  # names no job; the servicer answers it INVALID_ARGUMENT
        job: str = request.round.job
        return None if grant.allows(job) else _denied(grant, job)

    if name in ("Reduce", "GetRound", "ReduceStream", "Claim"):
        return checked(handler, own_round)
    if name == "ListRounds":
        unary = handler.unary_unary

        async def listing(
            request: pb.ListRoundsRequest, context: grpc.aio.ServicerContext[Any, Any]
        ) -> pb.ListRoundsResponse:
            if request.job:
                if not grant.allows(request.job):
                    await context.abort_with_status(_denied(grant, request.job))
                response: pb.ListRoundsResponse = await unary(request, context)
                return response
            everything: pb.ListRoundsResponse = await unary(request, context)
            return pb.ListRoundsResponse(
                rounds=[r for r in everything.rounds if grant.allows(r.round.job)]
            )

        return with_behavior(handler, listing)
    # A method this interceptor does not know how to scope: fail closed.
    return refusing(
        handler,
        _refusal(
            code_pb2.PERMISSION_DENIED,
            f"the bearer token ({grant.source}) is scoped to jobs and {method} is not job-scoped",
        ),
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without a valid bearer token; confines scoped tokens to their jobs."""

    def __init__(self, registry: TokenRegistry) -> None:
        self._registry = registry
        self._unauthenticated_methods = _UNAUTHENTICATED_METHODS
        self._scoped: dict[tuple[str, TokenGrant], tuple[Handler, Handler]] = {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        method: str = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self._unauthenticated_methods):
            return handler
        token = _presented_token(handler_call_details)
        if token is None:
            return refusing(
                handler,
                _refusal(
                    code_pb2.UNAUTHENTICATED,
                    f"{method} needs a bearer token: send metadata "
                    f"'{AUTHORIZATION_HEADER}: Bearer <token>'",
                ),
            )
        grant = self._registry.authenticate(token)
        if grant is None:
            _log.warning("refused %s: unknown bearer token", method)
            return refusing(
                handler,
                _refusal(code_pb2.UNAUTHENTICATED, f"{method}: the bearer token is not valid"),
            )
        if grant.jobs is None:
            return handler
        # Wrap each (method, grant) once; the registered handler is one object per method.
        cached = self._scoped.get((method, grant))
        if cached is not None and cached[0] is handler:
            return cached[1]
        scoped = _scoped(method, handler, grant)
        self._scoped[(method, grant)] = (handler, scoped)
        return scoped
