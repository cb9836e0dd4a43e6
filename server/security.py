"""TLS and mutual TLS credentials, and the rule for where the coordinator may listen.

- ``--tls-cert`` and ``--tls-key`` (PEM files) turn on TLS: clients verify the
  server against the CA that signed the certificate.
- ``--tls-client-ca`` (PEM, needs TLS) turns on mutual TLS: a client must
  present a certificate signed by that CA, or the handshake fails.
- **Binding rule.** Listening on anything but a loopback address exposes every
  job's rounds to whoever can reach the port. The coordinator refuses to do
  that without a token or TLS unless ``--insecure`` says the network is
  trusted, and the refusal says why and what to pass.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "InsecureBindingError",
    "TlsConfigError",
    "TlsFiles",
    "check_binding",
    "is_loopback",
    "server_credentials",
]

_log = logging.getLogger(__name__)


class TlsConfigError(ValueError):
    """The TLS flags are inconsistent or a PEM file cannot be read; names the flag and file."""


class InsecureBindingError(ValueError):
    """The coordinator would listen on a non-loopback address with no protection."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM contents of a TLS configuration (read once, at start)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None

    @classmethod
    def load(cls, cert: Path | None, key: Path | None, client_ca: Path | None) -> TlsFiles | None:
        """Read the files behind ``--tls-cert/--tls-key/--tls-client-ca``; None when TLS is off."""
        if cert is None and key is None:
            if client_ca is not None:
                raise TlsConfigError(
                    f"--tls-client-ca {str(client_ca)!r} needs --tls-cert and --tls-key: "
                    "mutual TLS is TLS plus client certificates"
                )
            return None
        if cert is None or key is None:
            given, missing = (
                ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
            )
            raise TlsConfigError(f"{given} was given without {missing}; TLS needs both")
        return cls(
            cert_chain=_read_pem("--tls-cert", cert),
            private_key=_read_pem("--tls-key", key),
            client_ca=None if client_ca is None else _read_pem("--tls-client-ca", client_ca),
        )


def _read_pem(flag: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag} {str(path)!r} cannot be read: {exc}") from exc
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag} {str(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials for TLS, requiring client certificates when a client CA is set."""
    return grpc.ssl_server_credentials(
        [(tls.private_key, tls.cert_chain)],
        root_certificates=tls.client_ca,
        require_client_auth=tls.client_ca is not None,
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine.

    ``localhost`` and literal loopback addresses (127.0.0.0/8, ::1) do; the
    wildcard (``0.0.0.0``, ``::``, empty) and any other name or address do not
    (a name is not resolved: it could point anywhere).
    """
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_binding(host: str, port: int, *, token: bool, tls: bool, insecure: bool) -> None:
    """Refuse an unprotected non-loopback listener (see the module doc); warn about weak ones."""
    if is_loopback(host):
        return
    where = f"{host}:{port}"
    if not token and not tls:
        if insecure:
            _log.warning(
                "listening on %s without a token or TLS (--insecure): anyone who can reach it "
                "can read and write every job's rounds",
                where,
            )
            return
        raise InsecureBindingError(
            f"refusing to listen on {where} without a token or TLS: {host!r} is not a loopback "
            "address, so anyone who can reach this port could read every job's rounds and send "
            "contributions in any rank's name. Pass --token-file (or set LOSSREDUCE_TOKEN), "
            "or --tls-cert and --tls-key, or --insecure if this network is trusted."
        )
    if token and not tls:
        _log.warning(
            "listening on %s with bearer tokens but without TLS: tokens cross the network in "
            "clear text; add --tls-cert/--tls-key",
            where,
        )
