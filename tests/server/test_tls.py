"""TLS, mutual TLS, the binding rule and the client's credentials, against a real server.

Every certificate is made here, by a throwaway CA generated with ``cryptography``.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lossreduce.client import (
    AuthenticationError,
    ClientSettings,
    CoordinatorUnavailableError,
    ReductionClient,
)
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.server.security import (
    InsecureBindingError,
    TlsConfigError,
    TlsFiles,
    check_binding,
    is_loopback,
)

SERVER_NAME = "coordinator.test"


# -- a throwaway PKI --------------------------------------------------------------


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Issued:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Issued(cert_path, key_path)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.CertificateBuilder:
    """A certificate valid for a day, from five minutes ago (clock skew)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )


class Authority:
    """A self-signed CA that issues server and client certificates."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            _builder(_name(name), _name(name), self.key, ca=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.root = _write(directory, name, self.cert, self.key).cert

    def issue(self, stem: str, *, server: bool) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(_name(stem), self.cert.subject, key, ca=False).add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName(SERVER_NAME),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        return _write(self.directory, stem, builder.sign(self.key, hashes.SHA256()), key)


@dataclass(frozen=True)
class Pki:
    ca: Authority
    rogue: Authority
    server: Issued
    client: Issued
    rogue_client: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "test-ca")
    rogue = Authority(directory, "rogue-ca")
    return Pki(
        ca=ca,
        rogue=rogue,
        server=ca.issue("server", server=True),
        client=ca.issue("client", server=False),
        rogue_client=rogue.issue("rogue-client", server=False),
    )


# -- helpers ----------------------------------------------------------------------

BASE = {
    "host": "127.0.0.1",
    "port": 0,
    "metrics_port": None,
    "round_timeout_s": 5.0,
    "shutdown_grace_s": 0.2,
}


@pytest.fixture
def start() -> Iterator[object]:
    running: list[CoordinatorThread] = []

    def make(**overrides: object) -> CoordinatorThread:
        coord = CoordinatorThread(CoordinatorSettings.model_validate({**BASE, **overrides})).start()
        running.append(coord)
        return coord

    yield make
    for coord in running:
        coord.stop(0.1)


def _client_settings(**fields: object) -> ClientSettings:
    # No retries: a refused handshake should surface at once.
    return ClientSettings.model_validate(
        {"retry_budget_s": 0.0, "call_timeout_s": 10.0, "token": None, **fields}
    )


def _reduce(target: str, settings: ClientSettings, job: str = "tls") -> dict[str, float]:
    with ReductionClient(
        target, job=job, group="actor", rank=0, world_size=1, settings=settings
    ) as client:
        return client.reduce(0, {"tokens": 12.0})


# -- TLS ---------------------------------------------------------------------------


def test_a_tls_coordinator_serves_a_client_that_trusts_its_ca(start, pki: Pki) -> None:
    coord = start(tls_cert=pki.server.cert, tls_key=pki.server.key)
    for use_stream in (True, False):
        settings = _client_settings(tls_root_cert=pki.ca.root, use_stream=use_stream)
        assert _reduce(coord.target, settings, job=f"tls-{use_stream}") == {"tokens": 12.0}


def test_a_client_checks_the_server_name(start, pki: Pki) -> None:
    coord = start(tls_cert=pki.server.cert, tls_key=pki.server.key)
    target = f"localhost:{coord.port}"  # the certificate names coordinator.test and 127.0.0.1
    with pytest.raises(CoordinatorUnavailableError):
        _reduce(target, _client_settings(tls_root_cert=pki.ca.root))
    named = _client_settings(tls_root_cert=pki.ca.root, tls_server_name=SERVER_NAME)
    assert _reduce(target, named) == {"tokens": 12.0}


@pytest.mark.parametrize(
    "client",
    [
        pytest.param({}, id="plaintext"),
        pytest.param({"tls": True}, id="system-roots"),
        pytest.param({"use_rogue_root": True}, id="other-ca"),
    ],
)
def test_a_client_that_cannot_verify_the_server_gets_no_round(
    start, pki: Pki, client: dict[str, object]
) -> None:
    coord = start(tls_cert=pki.server.cert, tls_key=pki.server.key)
    if client.pop("use_rogue_root", False):
        client["tls_root_cert"] = pki.rogue.root
    with pytest.raises(CoordinatorUnavailableError):
        _reduce(coord.target, _client_settings(**client))


# -- mutual TLS --------------------------------------------------------------------


@pytest.fixture
def mtls(start, pki: Pki) -> CoordinatorThread:
    coord: CoordinatorThread = start(
        tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca.root
    )
    return coord


def test_mutual_tls_accepts_a_certificate_from_the_client_ca(
    mtls: CoordinatorThread, pki: Pki
) -> None:
    settings = _client_settings(
        tls_root_cert=pki.ca.root, tls_client_cert=pki.client.cert, tls_client_key=pki.client.key
    )
    assert _reduce(mtls.target, settings) == {"tokens": 12.0}


@pytest.mark.parametrize("which", ["none", "rogue"])
def test_mutual_tls_refuses_clients_without_a_trusted_certificate(
    mtls: CoordinatorThread, pki: Pki, which: str
) -> None:
    fields: dict[str, object] = {"tls_root_cert": pki.ca.root}
    if which == "rogue":
        fields |= {"tls_client_cert": pki.rogue_client.cert, "tls_client_key": pki.rogue_client.key}
    with pytest.raises(CoordinatorUnavailableError):
        _reduce(mtls.target, _client_settings(**fields))


def test_tls_and_a_token_together(start, pki: Pki, tmp_path: Path) -> None:
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{token} tls-job\n")
    token_file.chmod(0o600)
    coord = start(tls_cert=pki.server.cert, tls_key=pki.server.key, token_file=token_file)
    good = _client_settings(tls_root_cert=pki.ca.root, token=token)
    assert _reduce(coord.target, good, job="tls-job") == {"tokens": 12.0}
    with pytest.raises(AuthenticationError) as info:
        _reduce(coord.target, _client_settings(tls_root_cert=pki.ca.root), job="tls-job")
    assert info.value.job == "tls-job"
    with pytest.raises(AuthenticationError, match="may not use job 'other-job'"):
        _reduce(coord.target, good, job="other-job")


def test_the_client_takes_its_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, start, tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{token}\n")
    token_file.chmod(0o600)
    coord = start(token_file=token_file)
    monkeypatch.setenv("LOSSREDUCE_TOKEN", f"{token} job-a,job-b")
    settings = ClientSettings(retry_budget_s=0.0)
    assert settings.token is not None
    assert token not in repr(settings)
    assert _reduce(coord.target, settings) == {"tokens": 12.0}
    monkeypatch.delenv("LOSSREDUCE_TOKEN")
    with pytest.raises(AuthenticationError):
        _reduce(coord.target, ClientSettings(retry_budget_s=0.0))


def test_the_server_reads_its_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, start
) -> None:
    token = secrets.token_urlsafe(24)
    monkeypatch.setenv("LOSSREDUCE_TOKEN", token)
    coord = start()
    assert _reduce(coord.target, _client_settings(token=token)) == {"tokens": 12.0}
    with pytest.raises(AuthenticationError):
        _reduce(coord.target, _client_settings(token=secrets.token_urlsafe(24)))


# -- configuration errors and the binding rule ------------------------------------


def test_tls_flags_must_come_together(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(TlsConfigError, match="--tls-cert was given without --tls-key"):
        TlsFiles.load(pki.server.cert, None, None)
    with pytest.raises(TlsConfigError, match=r"--tls-client-ca .* needs --tls-cert"):
        TlsFiles.load(None, None, pki.ca.root)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello")
    with pytest.raises(TlsConfigError, match=r"--tls-key .*garbage\.pem.* is not a PEM file"):
        TlsFiles.load(pki.server.cert, garbage, None)
    with pytest.raises(TlsConfigError, match=r"--tls-cert .*missing\.pem.* cannot be read"):
        TlsFiles.load(tmp_path / "missing.pem", pki.server.key, None)
    with pytest.raises(ValueError, match="tls_client_cert and tls_client_key go together"):
        ClientSettings(tls_client_cert=pki.client.cert)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("coordinator.internal", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_binding_rule() -> None:
    check_binding("127.0.0.1", 1, token=False, tls=False, insecure=False)
    for token, tls, insecure in ((True, False, False), (False, True, False), (False, False, True)):
        check_binding("0.0.0.0", 1, token=token, tls=tls, insecure=insecure)
    with pytest.raises(
        InsecureBindingError, match=r"refusing to listen on 0\.0\.0\.0:1 without a token or TLS"
    ):
        check_binding("0.0.0.0", 1, token=False, tls=False, insecure=False)


def test_an_unprotected_coordinator_refuses_every_interface(start, pki: Pki) -> None:
    with pytest.raises(InsecureBindingError, match="--insecure"):
        start(host="0.0.0.0")
    # Each protection (or the explicit opt-out) lets it start.
    start(host="0.0.0.0", insecure=True)
    start(host="0.0.0.0", tls_cert=pki.server.cert, tls_key=pki.server.key)


def test_lossreduce_serve_says_why_it_refuses(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lossreduce.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0:0 without a token or TLS" in result.stderr
    assert "--insecure" in result.stderr
    assert not list(tmp_path.iterdir()), "a refused start leaves no journal behind"


def test_lossreduce_status_uses_the_same_credentials(
    start,
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lossreduce.client import status_cli

    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{token}\n")
    token_file.chmod(0o600)
    coord = start(tls_cert=pki.server.cert, tls_key=pki.server.key, token_file=token_file)
    _reduce(coord.target, _client_settings(tls_root_cert=pki.ca.root, token=token), job="seen")
    argv = ["--coordinator", coord.target, "--tls-root-cert", str(pki.ca.root)]
    monkeypatch.delenv("LOSSREDUCE_TOKEN", raising=False)
    assert status_cli.main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("LOSSREDUCE_TOKEN", token)
    assert status_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "seen" in out
    assert token not in out
