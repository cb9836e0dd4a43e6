"""The run's own CA and coordinator certificate (no Ray: a real coordinator and client)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from pydantic import SecretStr

from lossreduce.client import ClientSettings, ReductionClient
from lossreduce.errors import CoordinatorUnavailableError, UsageError
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from lossreduce.trainer_worker.integrations.coordinator_actor import _tls_files
from lossreduce.trainer_worker.integrations.tls import make_run_tls, read_ca

TOKEN = SecretStr("run-token-" + "x" * 20)


def _client(target: str, settings: ClientSettings) -> ReductionClient:
    return ReductionClient(target, job="tls", group="g", rank=0, world_size=1, settings=settings)


def test_the_certificate_names_the_coordinator_node_and_chains_to_the_run_ca() -> None:
    tls = make_run_tls("job-1", ["10.1.2.3"])
    cert = x509.load_pem_x509_certificate(tls.server.cert_chain)
    ca = x509.load_pem_x509_certificate(tls.ca_cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {
        "10.1.2.3",
        "127.0.0.1",
    }
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert tls.server.private_key.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert b"PRIVATE KEY" not in repr(tls).encode()


def test_key_files_are_private_and_gone_after_use() -> None:
    tls = make_run_tls("job-2", ["127.0.0.1"]).server
    with _tls_files(tls) as (cert, key):
        assert cert is not None
        assert key is not None
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
        assert key.read_bytes() == tls.private_key
    assert not key.parent.exists()


@pytest.mark.timeout(60)
def test_only_a_client_with_the_run_ca_gets_through(tmp_path: Path) -> None:
    tls = make_run_tls("job-3", ["127.0.0.1"])
    with _tls_files(tls.server) as (cert, key):
        settings = CoordinatorSettings(
            host="127.0.0.1",
            port=0,
            metrics_port=None,
            round_timeout_s=5.0,
            token=TOKEN,
            tls_cert=cert,
            tls_key=key,
        )
        thread = CoordinatorThread(settings).start()
    try:
        good = _client(thread.target, ClientSettings(token=TOKEN, tls_root_cert_pem=tls.ca_cert))
        with good:
            assert good.reduce(0, {"pg": 4.0}) == {"pg": 4.0}
        other = make_run_tls("another-run", ["127.0.0.1"]).ca_cert
        for settings_without_ca in (
            ClientSettings(token=TOKEN, retry_budget_s=0.5),  # plaintext
            ClientSettings(token=TOKEN, tls_root_cert_pem=other, retry_budget_s=0.5),
        ):
            with (
                _client(thread.target, settings_without_ca) as client,
                pytest.raises(CoordinatorUnavailableError),
            ):
                client.reduce(1, {"pg": 4.0})
    finally:
        thread.stop()


def test_tls_ca_must_be_a_readable_pem_bundle(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--tls-ca .* cannot be read"):
        read_ca(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(UsageError, match="not a PEM certificate"):
        read_ca(junk)
    good = tmp_path / "ca.pem"
    good.write_bytes(make_run_tls("j", []).ca_cert)
    assert read_ca(good) == good.read_bytes()


def test_one_ca_source_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two CA bundles"):
        ClientSettings(tls_root_cert=tmp_path / "ca.pem", tls_root_cert_pem=b"x")
