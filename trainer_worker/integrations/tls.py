"""TLS for one training run: a private CA and the coordinator's certificate.

When the embedded coordinator listens beyond loopback (a cluster of several
nodes), the bearer token must not cross the network in clear text. The
driver then makes, in memory:

- a CA of this run (an EC P-256 key that signs exactly one certificate and is
  dropped right after: nothing can sign another certificate of this run);
- the coordinator's certificate, with the coordinator node's IP addresses
  (and ``localhost``/``127.0.0.1``) as subject alternative names.

The CA certificate (public) goes to every worker and agent through Ray as
actor constructor arguments; the server key goes only to the coordinator
actor, the same way (see :mod:`lossreduce.trainer_worker.integrations.coordinator_actor`
for the only moment it touches a disk). Nothing here logs, and the key is kept
out of ``repr``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lossreduce._compat import UTC
from lossreduce.errors import UsageError

__all__ = ["RUN_CERT_LIFETIME", "RunTls", "ServerTls", "make_run_tls", "read_ca"]

RUN_CERT_LIFETIME = timedelta(days=30)
"""How long the run's CA and certificate are valid: longer than any run."""

_CLOCK_SKEW = timedelta(minutes=5)
"""Certificates start this long before now, so nodes whose clocks lag accept them."""


@dataclass(frozen=True)
class ServerTls:
    """The coordinator's certificate chain and private key, PEM (the key never in ``repr``)."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)


@dataclass(frozen=True)
class RunTls:
    """What a run's TLS consists of: the CA certificate clients trust, the server's pair."""

    ca_cert: bytes
    server: ServerTls


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lossreduce train"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        ]
    )


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    seen: set[str] = set()
    for host in ("127.0.0.1", *hosts):
        if host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, now: datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + RUN_CERT_LIFETIME)
    )


def make_run_tls(job: str, hosts: Sequence[str], now: datetime | None = None) -> RunTls:
    """A fresh CA and a coordinator certificate valid for ``hosts`` (IPs or names)."""
    now = now or datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"lossreduce run CA {job}")
    ca_usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    ca_cert = (
        _builder(ca_name, ca_name, ca_key, now)
        # path_length=0: the CA signs end-entity certificates only.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca_usage, critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        _builder(_name(f"lossreduce coordinator {job}"), ca_name, server_key, now)
        .add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return RunTls(
        ca_cert=ca_cert.public_bytes(pem),
        server=ServerTls(
            cert_chain=server_cert.public_bytes(pem),
            private_key=server_key.private_bytes(
                pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        ),
    )


def read_ca(path: Path) -> bytes:
    """The PEM CA bundle behind ``--tls-ca``, read on the driver (workers need no copy)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UsageError(f"--tls-ca {str(path)!r} cannot be read: {err}") from err
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise UsageError(f"--tls-ca {str(path)!r} is not a PEM certificate bundle")
    return data
