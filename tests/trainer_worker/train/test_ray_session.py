"""The local Ray cluster that ``lossreduce train`` starts: quiet, and as secure as Ray's default."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.timeout(240)
def test_a_local_start_is_a_cluster_of_its_own_beside_another_on_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    ready = tmp_path / "other-gcs"
    # Another driver's local cluster on this machine, alive while this run starts.
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, sys, time, ray\n"
            "ray.init(address='local', num_cpus=1, include_dashboard=False)\n"
            f"pathlib.Path({str(ready)!r}).write_text(ray.get_runtime_context().gcs_address)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert other.poll() is None, "the other cluster's driver died"
            assert time.monotonic() < deadline, "the other cluster did not start"
            time.sleep(0.5)
        with driver._ray_session(TrainSettings(num_cpus=1, address=None)) as started_local:
            assert started_local
            assert ray.get_runtime_context().gcs_address != ready.read_text()
    finally:
        assert other.stdin is not None
        other.stdin.close()  # its driver ends, and its cluster with it
        other.wait(timeout=60)


def test_a_local_start_that_timed_out_is_reaped_and_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray's own timeout cannot be provoked on demand: the first start here is a real
    start whose processes keep running, then fails with Ray's words for a raylet that
    missed its window; the run reaps them and its second start serves."""
    if ray.is_initialized():
        ray.shutdown()
    real_init = ray.init
    calls: list[int] = []

    def slow_then_real(**kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            real_init(**kwargs)
            raise Exception("The current node timed out during startup. This could happen ...")
        return real_init(**kwargs)

    monkeypatch.setattr(ray, "init", slow_then_real)
    settings = TrainSettings(workers=1, num_cpus=1, progress=False)
    with caplog.at_level(logging.WARNING), driver._ray_session(settings):
        assert ray.is_initialized()
        assert ray.cluster_resources().get("CPU") == 1.0
    # 2, or 3 where the machine's load made the real second start time out too (the
    # retry this test checks then served once more, as it should).
    assert len(calls) >= 2
    assert "a local Ray start timed out" in caplog.text
    assert "trying again (2/3)" in caplog.text
    assert not ray.is_initialized()


def test_a_local_start_that_failed_otherwise_is_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if ray.is_initialized():
        ray.shutdown()
    calls: list[int] = []

    def broken(**_: object) -> None:
        calls.append(1)
        raise RuntimeError("Address already in use")

    monkeypatch.setattr(ray, "init", broken)
    settings = TrainSettings(workers=1, num_cpus=1, progress=False)
    with (
        pytest.raises(driver.TrainingFailedError, match="cannot start or join a local Ray"),
        driver._ray_session(settings),
    ):
        pass
    assert calls == [1]
