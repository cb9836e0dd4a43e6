"""``lossreduce agent``: bad flags, an unreachable coordinator, and a real agent
process serving ranks and its /metrics until SIGTERM."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from lossreduce.client import ClientSettings, ReductionClient
from lossreduce.client.agent_cli import PROG, main
from tests.conftest import flag_error

JOB = "agent-cli"
STARTUP_TIMEOUT_S = 60.0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--upstream", "127.0.0.1:1", "--local-ranks", "1,1"], "--local-ranks 1,1: "),
        (["--upstream", "127.0.0.1:1", "--world-size", "0"], "--world-size 0: "),
        (["--local-ranks", "0"], "the following arguments are required: --upstream"),
        (["--upstream", "127.0.0.1:1", "--token", "x"], "unrecognized arguments: --token x"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(argv, expected, capsys):
    assert flag_error(main, argv, capsys, PROG).startswith(expected)


def test_an_unreachable_coordinator_ends_the_command_naming_it(free_port, capsys):
    upstream = f"127.0.0.1:{free_port()}"
    assert main(["--upstream", upstream, "--retry-budget-s", "0.2", "--local-ranks", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG}: node agent 127.0.0.1:")
    assert f"the coordinator at {upstream} cannot be reached" in err


def test_the_agent_command_serves_ranks_and_metrics_until_sigterm(coordinator, free_port):
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "LOSSREDUCE_TOKEN": ""}
    argv = [
        *(sys.executable, "-m", "lossreduce.cli", "agent"),
        *("--upstream", coordinator.target, "--job", JOB, "--local-ranks", "0,1"),
        *("--port", str(port), "--metrics-port", str(metrics_port), "--shutdown-grace-s", "0.2"),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"lossreduce agent serving on 127.0.0.1:{port} "), line
        assert f"for the coordinator at {coordinator.target}" in line
        assert "local ranks: 0,1" in line
        settings = ClientSettings(token=None, retry_budget_s=1.0, call_timeout_s=30.0)
        clients = [
            ReductionClient(
                f"127.0.0.1:{port}", job=JOB, group="actor", rank=r, world_size=2, settings=settings
            )
            for r in (0, 1)
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(c.reduce, 0, {"n": 1.5}) for c in clients]
            assert [c.result(timeout=30) for c in calls] == [{"n": 3.0}] * 2
        for client in clients:
            client.close()
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert f'lossreduce_agent_rounds_forwarded_total{{group="actor",job="{JOB}"}} 1.0' in text
        assert f'lossreduce_agent_info{{upstream="{coordinator.target}"}} 1.0' in text
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=STARTUP_TIMEOUT_S)
        assert proc.returncode == 0, out
        assert out.rstrip().endswith(f"{PROG}: stopped"), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
