"""``lossreduce serve`` as a real process, ranks in separate processes, and flag handling."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lossreduce.errors import CoordinatorUnavailableError
from lossreduce.ports import free_port
from lossreduce.server import SERVICE_NAME, CoordinatorSettings, CoordinatorThread
from lossreduce.server.cli import PROG, SERVE_JOURNAL, build_parser, main, settings_from_args
from lossreduce.settings_cli import flag_name
from lossreduce.v2 import coordinator_pb2 as pb
from tests.conftest import flag_error
from tests.raw_stub import CALL_TIMEOUT_S, Ranks, Received, Send

LOSSREDUCE = Path(sys.executable).with_name("lossreduce")

# One rank in its own process: raw stubs, prints "OK <value>" or "<code name> <reason>".
RANK_SCRIPT = """
import sys, grpc
from grpc_status import rpc_status
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc
target, rank, world, value = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
request = pb.ReduceRequest(
    round=pb.RoundKey(job="procs", group="actor", step=5), rank=rank, world_size=world,
    partials=[pb.TermPartial(term="tokens", value=value, contract="mean:token_mean")])
with grpc.insecure_channel(target) as channel:
    try:
        response = pb_grpc.ReductionCoordinatorStub(channel).Reduce(request, timeout=60)
        print("OK", response.normalizers[0].value.hex())
    except grpc.RpcError as err:
        print(err.code().name, type(from_status(rpc_status.from_call(err))).__name__)
"""


def _rank_process(target: str, rank: int, world: int, value: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, target, str(rank), str(world), repr(value)],
        stdout=subprocess.PIPE,
        text=True,
    )


# Starting a Python process can take seconds on a loaded machine; the round must outlive it.
@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_ranks_in_separate_processes_and_threads_share_one_round(
    coordinator: CoordinatorThread,
) -> None:
    world = 6
    values = [0.1 * (r + 1) for r in range(world)]
    procs = [_rank_process(coordinator.target, r, world, values[r]) for r in range(3)]
    ranks = Ranks(coordinator.target)
    threads = ranks.round(
        [
            Send(rank=r, world_size=world, partials={"tokens": values[r]}, job="procs", step=5)
            for r in range(3, world)
        ],
        "stream",
    )
    ranks.close()
    expected = math.fsum(values)
    outputs = [p.communicate(timeout=CALL_TIMEOUT_S)[0].split() for p in procs]
    assert outputs == [["OK", expected.hex()]] * 3
    assert [t.normalizers["tokens"][0] for t in threads] == [expected] * 3


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A real ``lossreduce serve`` process and its target; killed if a test leaves it running.

    It runs in ``tmp_path``, so whatever it writes next to itself stays there."""
    port = free_port()
    proc = subprocess.Popen(
        [
            str(LOSSREDUCE),
            "serve",
            "--port",
            str(port),
            "--round-timeout-s",
            "30",
            "--metrics-port",
            "0",
            "--shutdown-grace-s",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    assert f"serving on 127.0.0.1:{port}" in banner, banner + (
        proc.stderr.read() if proc.stderr else ""
    )
    assert "round timeout 30 s" in banner
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serve_reports_serving_and_drains_on_sigterm(
    served: tuple[subprocess.Popen[str], str],
) -> None:
    proc, target = served
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING

    ranks = Ranks(target)
    waiting = Send(rank=0, world_size=2, partials={"tokens": 1.0})
    answers: list[Received] = []
    thread = threading.Thread(target=lambda: answers.append(ranks.unary(waiting)))
    thread.start()
    key = pb.RoundKey(job="job-t", group="actor", step=1)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not ranks.stub.GetRound(
        pb.GetRoundRequest(round=key), timeout=CALL_TIMEOUT_S
    ).arrived_ranks:
        assert time.monotonic() < deadline, "rank 0 never arrived"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=CALL_TIMEOUT_S)
    thread.join()
    ranks.close()
    assert proc.returncode == 0, err
    assert "stopped" in out
    assert answers[0].code == code_pb2.UNAVAILABLE
    assert isinstance(answers[0].error, CoordinatorUnavailableError)
    assert "shut down before ranks [1] arrived" in answers[0].error.message


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--port", "abc"], "--port abc: Input should be a valid integer"),
        (["--round-timeout-s", "0"], "--round-timeout-s 0: Input should be greater than 0"),
        (["--max-terms", "-3"], "--max-terms -3: Input should be greater than or equal to 1"),
        (["--journal-sync", "fast"], "--journal-sync fast: Input should be 'normal' or 'full'"),
        (["--round-timeout", "3"], "unrecognized arguments: --round-timeout 3"),
        (["--token", "secret"], "unrecognized arguments: --token secret"),
        (["--port"], "argument --port: expected one argument"),
    ],
)
def test_bad_flag_is_one_line_naming_flag_and_value(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flag_error(main, argv, capsys, PROG).startswith(expected)


def test_bad_environment_variable_is_named_with_its_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LOSSREDUCE_ROUND_TIMEOUT_S", "soon")
    assert main([]) == 2
    assert capsys.readouterr().err.startswith(
        "lossreduce serve: error: LOSSREDUCE_ROUND_TIMEOUT_S=soon: Input should be a valid number"
    )


def test_every_setting_but_the_token_is_a_described_flag_named_by_its_field() -> None:
    help_text = build_parser().format_help()
    for name, field in CoordinatorSettings.model_fields.items():
        assert field.description, f"{name} has no description"
        if name == "token":
            assert "--token " not in help_text  # command lines are visible to every user
            continue
        assert f"{flag_name(name)} " in help_text
        assert f"env LOSSREDUCE_{name.upper()}" in " ".join(help_text.split())
    assert flag_name("round_timeout_s") == "--round-timeout-s"


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOSSREDUCE_ROUND_TIMEOUT_S", "7")
    monkeypatch.setenv("LOSSREDUCE_MAX_TERMS", "5")
    args = build_parser().parse_args(["--round-timeout-s", "3.5", "--metrics-port", "off"])
    settings = settings_from_args(args)
    assert (settings.round_timeout_s, settings.max_terms, settings.metrics_port) == (3.5, 5, None)


def test_journal_defaults_to_the_serve_file_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOSSREDUCE_JOURNAL", raising=False)
    parse = build_parser().parse_args
    assert settings_from_args(parse([])).journal == SERVE_JOURNAL
    assert settings_from_args(parse(["--journal", "none"])).journal is None
    assert settings_from_args(parse(["--journal", "j.db"])).journal == Path("j.db")
    monkeypatch.setenv("LOSSREDUCE_JOURNAL", "off")
    assert settings_from_args(parse([])).journal is None
    monkeypatch.setenv("LOSSREDUCE_JOURNAL", "env.db")
    assert settings_from_args(parse([])).journal == Path("env.db")


def test_booleans_take_a_no_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOSSREDUCE_INSECURE", "1")
    parse = build_parser().parse_args
    assert settings_from_args(parse([])).insecure is True
    assert settings_from_args(parse(["--no-insecure"])).insecure is False
