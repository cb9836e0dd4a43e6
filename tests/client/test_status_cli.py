"""``lossreduce status`` names the rank a stuck round is waiting for."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lossreduce.client.status_cli import PROG, format_ranks, main
from lossreduce.ports import free_port
from lossreduce.server import CoordinatorThread
from lossreduce.v2 import coordinator_pb2 as pb
from tests.conftest import flag_error
from tests.raw_stub import CALL_TIMEOUT_S, Ranks, Send


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([], "-"), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([9, 1, 0], "0-1,9")],
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


def _start_stuck_round(ranks: Ranks, coordinator: CoordinatorThread) -> list[threading.Thread]:
    """Ranks 0, 2 and 3 of a 4-rank round arrive; rank 1 never does."""
    threads = [
        threading.Thread(
            target=ranks.unary,
            args=(Send(rank=r, world_size=4, partials={"t": 1.0}, job="stuck", step=42),),
        )
        for r in (0, 2, 3)
    ]
    for t in threads:
        t.start()
    key = pb.RoundKey(job="stuck", group="actor", step=42)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while len(ranks.stub.GetRound(pb.GetRoundRequest(round=key), timeout=5).arrived_ranks) < 3:
        assert time.monotonic() < deadline, "ranks 0, 2 and 3 never all arrived"
        time.sleep(0.01)
    return threads


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 30.0}], indirect=True)
def test_status_names_the_missing_rank(
    coordinator: CoordinatorThread, ranks: Ranks, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks.round([Send(rank=0, world_size=1, partials={"t": 1.0}, job="stuck", step=41)], "unary")
    threads = _start_stuck_round(ranks, coordinator)

    assert main(["--coordinator", coordinator.target, "--job", "stuck"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:7] == ["JOB", "GROUP", "RUN", "STEP", "STATE", "ARRIVED", "MISSING"]
    # The raw stub names no run (a client from before runs): RUN shows "-".
    assert rows[0].split()[:7] == ["stuck", "actor", "-", "42", "collecting", "3/4", "1"]
    assert rows[1].split()[:7] == ["stuck", "actor", "-", "41", "completed", "1/1", "-"]

    assert (
        main(
            [
                "--coordinator",
                coordinator.target,
                "--job",
                "stuck",
                "--group",
                "actor",
                "--step",
                "42",
            ]
        )
        == 0
    )
    (_, row) = capsys.readouterr().out.splitlines()
    assert row.split()[5:7] == ["3/4", "1"]

    # The console script itself, as an operator runs it.
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("lossreduce")),
            "status",
            "--coordinator",
            coordinator.target,
        ],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
        check=True,
    ).stdout
    assert "collecting" in out
    assert " 1 " in out.splitlines()[1]

    ranks.unary(Send(rank=1, world_size=4, partials={"t": 1.0}, job="stuck", step=42))
    for t in threads:
        t.join()


def test_status_of_a_failed_round_shows_its_error(
    coordinator: CoordinatorThread, ranks: Ranks, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks.unary(Send(rank=0, world_size=1, partials={"t": 0.0}, job="empty"))
    assert main(["--coordinator", coordinator.target]) == 0
    out = capsys.readouterr().out
    assert "failed" in out
    assert "global normalizer 't'=0.0" in out


def test_status_without_rounds_and_against_no_coordinator(
    coordinator: CoordinatorThread, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--coordinator", coordinator.target, "--job", "nothing"]) == 0
    assert "no live or recent rounds for job 'nothing'" in capsys.readouterr().out
    dead = f"127.0.0.1:{free_port()}"
    assert main(["--coordinator", dead, "--timeout-s", "0.5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lossreduce status: cannot query {dead}: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--coordinator", "x:1", "--group", "g"], "--group and --step go together"),
        (["--coordinator", "x:1", "--group", "g", "--step", "1"], "--group and --step need --job"),
        (["--coordinator", "x:1", "--step", "-1", "--group", "g", "--job", "j"], "--step -1: "),
        (["--coordinator", "x:1", "--timeout-s", "0"], "--timeout-s 0: "),
        (["--coordinator", "x:1", "--timeout", "1"], "unrecognized arguments: --timeout 1"),
        ([], "the following arguments are required: --coordinator"),
    ],
)
def test_status_flag_rules(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flag_error(main, argv, capsys, PROG).startswith(expected)
