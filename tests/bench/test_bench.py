"""`lossreduce bench`: the pure statistics, placement and report, plus a smoke run."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lossreduce.bench.cli import PROG, QUICK_DEFAULTS, BenchSettings, build_parser, main
from lossreduce.bench.contenders import (
    BareStreamRanks,
    CoordinatorStreamRanks,
    Endpoints,
)
from lossreduce.bench.e2e import abba, step_seconds
from lossreduce.bench.hosts import CONTENDERS, HIERARCHICAL, split_ranks
from lossreduce.bench.report import format_table, ratios, targets
from lossreduce.bench.run import place
from lossreduce.bench.stats import ContenderResult, percentile, round_latency_ns, summarize
from lossreduce.bench.workload import (
    TERMS,
    WrongSumError,
    check_sums,
    expected_sums,
    partials_for,
)
from lossreduce.settings_cli import flag_name, parse_settings
from tests.conftest import flag_error


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpy(values, q):
    got = percentile(sorted(values), q)
    assert math.isclose(got, float(np.percentile(values, q)), rel_tol=1e-9, abs_tol=1e-9)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_round_latency_spans_first_start_to_last_end():
    assert round_latency_ns([(10, 50), (5, 40), (20, 70)]) == 65


def test_summarize_reports_percentiles_rate_and_cpu_per_contribution():
    result = summarize(
        "x",
        8,
        [1_000_000, 3_000_000, 2_000_000],
        server_cpu_ns=2_400_000,
        contributions_per_round=8,
        rank_processes=8,
        simulated=False,
    )
    assert result.p50_ms == 2.0
    assert result.mean_ms == 2.0
    assert result.rounds_per_s == 500.0
    assert result.server_cpu_us_per_contribution == 100.0  # 2400 us / (3 rounds x 8)
    assert (
        summarize(
            "y",
            2,
            [1],
            server_cpu_ns=None,
            contributions_per_round=2,
            rank_processes=1,
            simulated=True,
        ).server_cpu_us_per_contribution
        is None
    )


@given(st.integers(1, 5000), st.integers(1, 64))
def test_split_ranks_covers_every_rank_once_in_near_equal_blocks(world_size, processes):
    blocks = split_ranks(world_size, processes)
    assert [r for block in blocks for r in block] == list(range(world_size))
    sizes = {len(b) for b in blocks}
    assert max(sizes) - min(sizes) <= 1
    assert len(blocks) == min(world_size, processes)


def test_place_simulates_above_max_processes_and_skips_gloo_beyond_its_limit():
    small = place(
        8,
        list(CONTENDERS),
        max_processes=16,
        gloo_max_processes=64,
        load_processes=4,
        ray_processes=4,
        ranks_per_node=8,
    )
    assert not small.simulated
    # 8 shared rank processes, then 8 for gloo and 4 for Ray of their own.
    assert small.processes == 8 + 8 + 4
    by = small.ranks_by_contender
    assert by["coordinator-stream"] == [(r,) for r in range(8)] + [()] * 12
    assert by["bare-stream"] == by["tcpstore"] == by["coordinator-stream"]
    assert by["gloo"] == [()] * 8 + [(r,) for r in range(8)] + [()] * 4
    assert by["ray-actor"] == [()] * 16 + split_ranks(8, 4)

    middle = place(
        64,
        list(CONTENDERS),
        max_processes=16,
        gloo_max_processes=64,
        load_processes=4,
        ray_processes=4,
        ranks_per_node=8,
    )
    assert middle.simulated
    assert middle.processes == 4 + 64 + 4  # gloo still gets a process per rank
    assert [b for b in middle.ranks_by_contender["tcpstore"] if b] == split_ranks(64, 4)
    assert [b for b in middle.ranks_by_contender["gloo"] if b] == [(r,) for r in range(64)]

    big = place(
        256,
        list(CONTENDERS),
        max_processes=16,
        gloo_max_processes=64,
        load_processes=4,
        ray_processes=4,
        ranks_per_node=8,
    )
    assert big.processes == 4 + 4
    assert "gloo" not in big.ranks_by_contender
    assert [s.contender for s in big.skipped] == ["gloo"]
    assert "N=256 exceeds the 64 processes" in big.skipped[0].reason


def test_place_keeps_hierarchical_nodes_whole_and_skips_partial_nodes():
    placed = place(
        64,
        ["coordinator-hierarchical", "coordinator-stream"],
        max_processes=16,
        gloo_max_processes=64,
        load_processes=3,
        ray_processes=4,
        ranks_per_node=8,
    )
    blocks = [b for b in placed.ranks_by_contender["coordinator-hierarchical"] if b]
    assert [r for b in blocks for r in b] == list(range(64))
    assert all(len(b) % 8 == 0 and b[0] % 8 == 0 for b in blocks)
    partial = place(
        12,
        ["coordinator-hierarchical"],
        max_processes=16,
        gloo_max_processes=64,
        load_processes=3,
        ray_processes=4,
        ranks_per_node=8,
    )
    assert [s.contender for s in partial.skipped] == ["coordinator-hierarchical"]


def _result(contender, n, p50, cpu=None):
    return summarize(
        contender,
        n,
        [int(p50 * 1e6)],
        server_cpu_ns=None if cpu is None else int(cpu * 1e3 * n),
        contributions_per_round=n,
        rank_processes=n,
        simulated=False,
    )


def test_ratios_and_targets_compare_the_stream_to_each_contender():
    results = [
        _result("coordinator-stream", 8, 3.0),
        _result("bare-echo", 8, 2.5),
        _result("tcpstore", 8, 1.5),
        _result("gloo", 8, 8.0),
        _result("coordinator-stream", 256, 18.0, cpu=50.0),
        _result("bare-echo", 256, 12.0, cpu=45.0),
        _result("tcpstore", 256, 100.0),
        _result("ray-actor", 256, 90.0),
        _result("coordinator-hierarchical", 48, 30.0),
        _result("hierarchical-echo", 48, 20.0),
    ]
    rows = {(r["world_size"], r["contender"]): r["p50_ratio"] for r in ratios(results)}
    assert rows[(8, "tcpstore")] == 2.0
    assert rows[(8, "gloo")] == 3.0 / 8.0
    by_name = {t.name.split(":")[0]: t for t in targets(results, hierarchical_world_size=48)}
    cpu = by_name["N=256"]
    assert cpu.met is True
    assert cpu.measured == 50.0 / 45.0
    echo = by_name["N=8,64,256"]
    assert echo.met is False
    assert echo.measured == 18.0 / 12.0  # the worst N
    assert "N=8: 3.000 / 2.500 = 1.20x" in echo.detail
    assert by_name["ranks behind node agents at scale (README"].met is False  # 1.5x
    assert by_name["N>=4"].met is True
    assert by_name["N>=64"].met is True  # TCPStore, the last N>=64 target
    (ray,) = [t for t in targets(results) if "Ray actor" in t.name]
    assert ray.met is True
    assert ray.measured == 18.0 / 90.0
    assert [t.met for t in targets(results[:1])][:3] == [None, None, None]
    table = format_table(results, [])
    assert "| 8 | tcpstore | 1.500 |" in table


def test_client_targets_compare_the_shipped_client_to_the_raw_stub():
    def rank_result(contender: str, n: int, p50_ms: float, client_us: float) -> ContenderResult:
        return summarize(
            contender,
            n,
            [int(p50_ms * 1e6)],
            server_cpu_ns=None,
            client_cpu_ns=int(client_us * 1e3 * n),
            contributions_per_round=n,
            rank_processes=n,
            simulated=False,
        )

    results = [
        rank_result("coordinator-stream", 1, 1.0, 500.0),
        rank_result("bare-stream", 1, 0.9, 450.0),
        rank_result("coordinator-stream", 8, 5.0, 650.0),
        rank_result("bare-stream", 8, 4.0, 500.0),
    ]
    by_name = {t.name.split(":")[0]: t for t in targets(results)}
    cpu = by_name["N=1,8"]
    assert cpu.measured == 650.0 / 500.0  # N=8 is the worse of the two
    assert cpu.met is False
    assert "N=1: 500.000 / 450.000 = 1.11x" in cpu.detail
    p50 = by_name["N=8"]
    assert p50.measured == 5.0 / 4.0
    assert p50.met is False


def test_workload_sums_are_exact_and_checked():
    expected = expected_sums(5, 3)
    for t in range(len(TERMS)):
        assert expected[t] == math.fsum(partials_for(r, 3)[t] for r in range(5))
    check_sums("c", 0, 3, expected, expected, exact=True)
    off = [expected[0] + 1e-12 * expected[0], *expected[1:]]
    check_sums("c", 0, 3, off, expected, exact=False)
    with pytest.raises(WrongSumError, match=r"c: rank 2 step 3 term 'tokens'"):
        check_sums("c", 2, 3, off, expected, exact=True)


def test_settings_reject_unknown_contenders_and_tiny_worlds():
    with pytest.raises(ValueError, match="unknown contenders"):
        BenchSettings(contenders=("mpi",))
    with pytest.raises(ValueError, match=">= 1"):
        BenchSettings(world_sizes=(0, 4))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--world-sizes", "0"],
            "--world-sizes 0: world sizes [0] must be non-empty and each >= 1",
        ),
        (["--world-sizes", "2,x"], "--world-sizes 2,x: Input should be a valid integer"),
        (["--contenders", "mpi"], "--contenders mpi: unknown contenders ['mpi']"),
        (["--n", "4"], "unrecognized arguments: --n 4"),
        (["--e2e-steps", "3", "--e2e-skip-steps", "3"], "e2e_steps 3 must exceed"),
    ],
)
def test_bad_flags_are_one_line_naming_flag_and_value(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flag_error(main, argv, capsys, PROG).startswith(expected)


def test_every_setting_is_a_flag_and_quick_only_changes_defaults() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for name, field in BenchSettings.model_fields.items():
        assert field.description, name
        assert flag_name(name) in help_text
    quick = parse_settings(BenchSettings, parser.parse_args(["--quick"]), defaults=QUICK_DEFAULTS)
    assert (quick.world_sizes, quick.rounds) == ((1, 2, 8, 64, 256), 30)
    given = parser.parse_args(["--quick", "--rounds", "7", "--world-sizes", "4,2,4"])
    mixed = parse_settings(BenchSettings, given, defaults=QUICK_DEFAULTS)
    assert (mixed.world_sizes, mixed.rounds, mixed.warmup_rounds) == ((2, 4), 7, 3)


def test_quick_bench_smoke(tmp_path: Path):
    """Every contender, tiny N, through the console script: sums checked by
    every load process, a JSON with a result per contender and N, a plot."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lossreduce.cli",
            "bench",
            "--quick",
            "--world-sizes",
            "1,4",
            "--rounds",
            "5",
            "--warmup-rounds",
            "1",
            "--ray-processes",
            "1",
            "--ranks-per-node",
            "2",
            "--hierarchical-nodes",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((out / "bench.json").read_text())
    measured = {(r["contender"], r["world_size"]) for r in payload["results"]}
    # N=1 is not a whole number of nodes of 2 ranks: the hierarchical pair skips it.
    flat = [c for c in CONTENDERS if c not in HIERARCHICAL]
    assert measured == {(c, 1) for c in flat} | {(c, 4) for c in CONTENDERS} | {
        ("coordinator-hierarchical", 6),
        ("hierarchical-echo", 6),
    }
    assert all(r["rounds"] == 5 and r["p50_ms"] > 0 for r in payload["results"])
    assert all(r["client_cpu_us_per_rank"] > 0 for r in payload["results"])
    served = [r for r in payload["results"] if r["contender"] not in ("gloo", "tcpstore")]
    assert all(r["server_cpu_us_per_contribution"] > 0 for r in served)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "coordinator-stream" in proc.stdout


def test_e2e_runs_alternate_abba_and_skip_warmup_steps(tmp_path: Path):
    assert abba(2) == ["torch", "coordinator", "coordinator", "torch"]
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": i, "step_seconds": 0.1 * (i + 1), "round_latency_s": 0.01, "skipped": i == 3}
        for i in range(5)
    ]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    seconds, latencies = step_seconds(metrics, skip=1)
    assert seconds == [0.2, 0.30000000000000004, 0.5]  # step 0 warm-up, step 3 skipped
    assert latencies == [0.01] * 3


def test_e2e_settings_need_steps_beyond_the_warmup():
    with pytest.raises(ValueError, match="must exceed e2e_skip_steps"):
        BenchSettings(e2e_steps=3, e2e_skip_steps=3)


def _established_to(port: int) -> int:
    """Established TCP connections whose remote end is ``port`` (from /proc; gRPC
    connects over IPv6 sockets with IPv4-mapped loopback addresses)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01":  # 01: ESTABLISHED
                count += 1
    return count


@pytest.mark.parametrize("contender", [BareStreamRanks, CoordinatorStreamRanks])
def test_simulated_ranks_each_hold_their_own_connection(coordinator, contender) -> None:
    # Ranks simulated as tasks of one process must not share a TCP connection
    # (grpc.aio shares one between a process's channels to a target by default):
    # a shared one batches their messages and makes the contender look cheaper.
    world = 3
    endpoints = Endpoints(
        coordinator=coordinator.target,
        store_host="",
        store_port=0,
        ray_address="",
        ray_actor="",
        job=f"conn-{contender.__name__}",
    )
    ranks = contender(endpoints, range(world), world)
    port = int(coordinator.target.rsplit(":", 1)[1])

    async def one_round() -> int:
        sums = ranks.run_round(0)
        assert not isinstance(sums, list)
        received = await sums
        assert len(received) == world
        connections = _established_to(port)
        closing = ranks.close()
        assert closing is not None
        await closing
        return connections

    assert asyncio.run(one_round()) == world
