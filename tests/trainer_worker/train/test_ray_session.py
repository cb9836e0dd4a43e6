"""The local Ray cluster that ``lossreduce train`` starts: quiet, and as secure as Ray's default."""

from __future__ import annotations

import logging
import os

import pytest
import ray
from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

from lossreduce.trainer_worker.train import driver
from lossreduce.trainer_worker.train.train_settings import TrainSettings

pytestmark = pytest.mark.ray


def test_the_token_notice_filter_drops_that_line_and_nothing_else() -> None:
    notice = driver._DropLocalTokenNotice()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray", logging.WARNING, __file__, 1, message, None, None)

    assert not notice.filter(record(f"{driver.RAY_TOKEN_NOTICE}. Set RAY_AUTH_MODE=disabled"))
    assert notice.filter(record("Token authentication is disabled for this Ray cluster. Anyone"))
    assert notice.filter(record("Some other Ray warning"))


def test_a_local_start_prints_no_token_notice_and_keeps_token_authentication(
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    settings = TrainSettings(num_cpus=1, address=None)
    with caplog.at_level(logging.INFO), driver._ray_session(settings) as started_local:
        assert started_local
        # Ray turned token authentication on by default, as it does for every new local cluster.
        assert get_authentication_mode() == AuthenticationMode.TOKEN
        assert os.environ.get("RAY_AUTH_MODE") == "token"
    assert not ray.is_initialized()
    # Ray's notice goes to the logging tree (pytest's handler here, stderr in a plain run).
    logged = [r.getMessage() for r in caplog.records]
    printed = capfd.readouterr()
    assert not [m for m in logged if "Token authentication" in m], logged
    assert "Token authentication" not in printed.out + printed.err
    # The filter is gone with the session: a later Ray start shows the notice again.
    assert not logging.getLogger(driver._RAY_AUTH_LOGGER).filters
