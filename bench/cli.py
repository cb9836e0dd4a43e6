"""``lossreduce bench``: the coordinator against gloo, TCPStore, a Ray actor and grpc's floor.

For each world size N, every contender runs R rounds in which N ranks each
send four named partials and all receive the sums; contenders are interleaved
round by round in one invocation. Reports p50/p99 round latency, rounds/s,
server CPU per contribution, client CPU per rank and round, and the
coordinator's ratio to every contender (the ``bare-echo`` reference among
them: a servicer with no round logic), checks the Performance
targets, and writes ``bench.json`` and ``bench.png`` to ``--out``.

    lossreduce bench --quick
    lossreduce bench --world-sizes 2,4,8,16,64,256 --rounds 200 --out bench-out
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lossreduce.bench.contenders import Endpoints
from lossreduce.bench.e2e import FRAMEWORK_E2E_KEYS, run_e2e, run_frameworks_e2e
from lossreduce.bench.hosts import CONTENDERS, ECHO, HIERARCHICAL
from lossreduce.bench.many_runs import ManyRunsSettings, format_many_runs, run_many_runs
from lossreduce.bench.report import (
    format_table,
    ratios,
    targets,
    write_json,
    write_plot,
)
from lossreduce.bench.run import CpuReader, WorldRun, place, run_world, settle
from lossreduce.bench.servers import (
    CoordinatorProcess,
    EchoProcess,
    process_cpu_ns,
    start_store,
)
from lossreduce.bench.stats import ContenderResult
from lossreduce.settings_cli import FlagError, SettingsParser, add_settings_flags, parse_settings

__all__ = [
    "PROG",
    "QUICK_DEFAULTS",
    "BenchSettings",
    "build_parser",
    "default_max_processes",
    "main",
    "run_bench",
]

PROG = "lossreduce bench"
_QUICK_WORLD_SIZES = (1, 2, 8, 64, 256)
QUICK_DEFAULTS: dict[str, object] = {
    "world_sizes": _QUICK_WORLD_SIZES,
    "rounds": 30,
    "warmup_rounds": 3,
}
"""What ``--quick`` changes from the defaults (flags given still win)."""
_FULL_WORLD_SIZES = (1, 2, 4, 8, 16, 64, 256)
_PROCESS_MEMORY_BYTES = 120 * 1024 * 1024
"""Resident memory budgeted per rank process (a forked torch + grpc interpreter
with a gloo group, measured about 100 MB) when sizing --max-processes."""


_OTHER_LOAD_PROCESSES = 8
"""Load processes beside gloo's at the largest N gloo runs at: the shared ones
(--load-processes) and the Ray drivers (--ray-processes), at their defaults."""


def _available_memory() -> int:
    """Bytes a new process can have: Linux's MemAvailable, which counts the page cache as
    free. Free pages alone (``SC_AVPHYS_PAGES``) shrink to little once a machine has read
    a few GB of files (a pip install), and gloo was then skipped at N=4 on 24 GiB."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 1024**3


def default_max_processes() -> int:
    """How many one-rank processes this machine holds: bounded by memory, by
    the open-file limit (a gloo rank keeps a socket to every peer) and at 64."""
    soft_files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    by_files = int((soft_files - 256) ** 0.5)  # the driver's store sees ~N^2/N sockets per rank
    available = _available_memory()
    # The shared and the Ray load processes (4 each by default) run beside gloo's.
    by_memory = int(available * 0.5) // _PROCESS_MEMORY_BYTES - _OTHER_LOAD_PROCESSES
    return max(2, min(64, by_files, by_memory))


class BenchSettings(BaseModel):
    """What one ``lossreduce bench`` run measures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_sizes: tuple[int, ...] = Field(
        default=_FULL_WORLD_SIZES,
        description="World sizes N to measure, each >= 1 (N=1: a round completes on "
        "arrival, so it isolates the client's own cost).",
    )
    rounds: int = Field(default=200, ge=1, description="Measured rounds per contender and N.")
    warmup_rounds: int = Field(
        default=5, ge=0, description="Rounds run first and not measured (connections, caches)."
    )
    contenders: tuple[str, ...] = Field(
        default=tuple(CONTENDERS),
        description=f"Contenders to run, a subset of {', '.join(CONTENDERS)}.",
    )
    max_processes: int = Field(
        default=16,
        ge=1,
        description="Largest N run with one process per rank; above it ranks are simulated as "
        "asyncio tasks over --load-processes processes (on 2 cores, more rank processes than "
        "that measure the scheduler, not the contender).",
    )
    gloo_max_processes: int = Field(
        default_factory=default_max_processes,
        ge=1,
        description="Largest N gloo runs at (it needs one process per rank); default: what the "
        "open-file limit and free memory allow, at most 64. gloo is skipped above it.",
    )
    load_processes: int = Field(
        default=4, ge=1, description="Load processes sharing the ranks when they are simulated."
    )
    ray_processes: int = Field(
        default=4,
        ge=1,
        description="Load processes (Ray drivers) sharing the Ray contender's ranks.",
    )
    ranks_per_node: int = Field(
        default=8, ge=1, description="Ranks behind each node-local aggregator (hierarchical)."
    )
    hierarchical_nodes: int = Field(
        default=512,
        ge=0,
        description="After the other world sizes, the hierarchical contender and its echo "
        "reference (hierarchical-echo) alone at N = nodes x --ranks-per-node simulated ranks "
        "(the Performance target of docs/performance.md: 512 x 8 = 4096); 0 skips it.",
    )
    e2e: bool = Field(
        default=False,
        description="Also compare a `lossreduce train` step with --normalizer coordinator "
        "against --normalizer torch (runs training in ABBA order), and a TRL GRPO step with "
        "lossreduce's normalizers against TRL's own dapo (skipped without lossreduce[trl]), "
        "verl's actor step for each of its engines that is installed (FSDP2, Megatron) and "
        "AReaL's PPO update for each of its engines that is installed (FSDP, Archon, "
        "Megatron) and SkyRL's policy update, each against the framework's own.",
    )
    e2e_main_ppo: bool = Field(
        default=True,
        description="With --e2e and verl installed, also time a whole verl main_ppo training "
        "step with the lossreduce trainer mode against stock verl (four launches of the tiny "
        "CPU launch, about 10 minutes on 2 cores).",
    )
    e2e_steps: int = Field(default=30, ge=2, description="Steps per end-to-end training run.")
    e2e_pairs: int = Field(
        default=2, ge=1, description="End-to-end runs per normalizer (ABBA order)."
    )
    e2e_workers: int = Field(default=2, ge=1, description="Ranks of each end-to-end run.")
    e2e_skip_steps: int = Field(
        default=3, ge=0, description="First steps of each end-to-end run left out (warm-up)."
    )
    out: Path = Field(default=Path("bench-out"), description="Folder for bench.json and bench.png.")
    startup_timeout_s: float = Field(
        default=300.0, gt=0, description="Bound on starting the load processes of one N."
    )

    @field_validator("world_sizes")
    @classmethod
    def _sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(n < 1 for n in value):
            raise ValueError(f"world sizes {list(value)} must be non-empty and each >= 1")
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _e2e_steps(self) -> BenchSettings:
        if self.e2e_steps <= self.e2e_skip_steps:
            raise ValueError(
                f"e2e_steps {self.e2e_steps} must exceed e2e_skip_steps {self.e2e_skip_steps}"
            )
        return self

    @field_validator("contenders")
    @classmethod
    def _contenders(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [c for c in value if c not in CONTENDERS]
        if unknown or not value:
            raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
        return tuple(c for c in CONTENDERS if c in value)


def _machine() -> dict[str, object]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import grpc
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class _Ray:
    """A local Ray cluster with one actor coordinator per world size."""

    def __init__(self) -> None:
        import ray

        ray.init(
            # Its own cluster, never one another job started on this machine.
            address="local",
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
        )
        self.address: str = ray.get_runtime_context().gcs_address
        self._actors: list[object] = []

    def actor(self, name: str) -> int:
        from lossreduce.bench.ray_contender import start_ray_coordinator

        actor, pid = start_ray_coordinator(name)
        self._actors.append(actor)
        return pid

    def stop(self) -> None:
        import ray

        ray.shutdown()


def _worlds(settings: BenchSettings) -> list[tuple[int, tuple[str, ...]]]:
    """Every (N, contenders) to measure: the world sizes, then the hierarchical scale run."""
    worlds = [(n, settings.contenders) for n in settings.world_sizes]
    big = settings.hierarchical_nodes * settings.ranks_per_node
    scale = tuple(c for c in settings.contenders if c in HIERARCHICAL)
    if big and scale and big not in settings.world_sizes:
        worlds.append((big, scale))
    return worlds


def _grpc(contender: str) -> bool:
    """Whether ``contender`` talks to a gRPC server of ours (the coordinator or the echo)."""
    return contender not in ("gloo", "tcpstore", "ray-actor")


class _Servers:
    """Every contender's server for the whole run."""

    def __init__(self, contenders: Sequence[str]) -> None:
        self.coordinator = (
            CoordinatorProcess() if any(c not in ECHO and _grpc(c) for c in contenders) else None
        )
        self.echo = EchoProcess() if any(c in ECHO for c in contenders) else None
        self.store = start_store()
        self.ray = _Ray() if "ray-actor" in contenders else None

    def endpoints(self, n: int, ranks_per_node: int) -> tuple[Endpoints, dict[str, CpuReader]]:
        readers: dict[str, CpuReader] = {}
        for name in CONTENDERS:
            server = self.echo if name in ECHO else self.coordinator
            if server is not None and _grpc(name):
                readers[name] = server.cpu_ns
        actor_name = f"bench-n{n}"
        if self.ray is not None:
            readers["ray-actor"] = functools.partial(process_cpu_ns, self.ray.actor(actor_name))
        endpoints = Endpoints(
            coordinator=self.coordinator.target if self.coordinator else "",
            echo=self.echo.target if self.echo else "",
            store_host="127.0.0.1",
            store_port=self.store.port,
            ray_address=self.ray.address if self.ray else "",
            ray_actor=actor_name,
            job=f"bench-n{n}",
            ranks_per_node=ranks_per_node,
        )
        return endpoints, readers

    def stop(self) -> None:
        if self.ray is not None:
            self.ray.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.echo is not None:
            self.echo.stop()


def run_bench(settings: BenchSettings) -> dict[str, object]:
    """Run every contender at every N; return the JSON payload (also written)."""
    servers = _Servers(settings.contenders)
    results: list[ContenderResult] = []
    skipped = []
    try:
        for n, contenders in _worlds(settings):
            placement = place(
                n,
                contenders,
                max_processes=settings.max_processes,
                gloo_max_processes=settings.gloo_max_processes,
                load_processes=settings.load_processes,
                ray_processes=settings.ray_processes,
                ranks_per_node=settings.ranks_per_node,
            )
            endpoints, readers = servers.endpoints(n, settings.ranks_per_node)
            how = (
                f"ranks simulated as asyncio tasks over at most {settings.load_processes} "
                "processes per contender"
                if placement.simulated
                else "one process per rank"
            )
            print(f"N={n}: {placement.processes} load processes ({how})", flush=True)
            began = time.monotonic()
            world = run_world(
                WorldRun(
                    world_size=n,
                    placement=placement,
                    endpoints=endpoints,
                    rounds=settings.rounds,
                    warmup_rounds=settings.warmup_rounds,
                    server_cpu=readers,
                    startup_timeout_s=settings.startup_timeout_s,
                )
            )
            for r in world:
                print(
                    f"  {r.contender:<24} p50 {r.p50_ms:8.3f} ms  p99 {r.p99_ms:8.3f} ms",
                    flush=True,
                )
            print(f"  ({time.monotonic() - began:.1f} s with start-up)", flush=True)
            results += world
            skipped += placement.skipped
            settle(0.5)
    finally:
        servers.stop()
    e2e = None
    frameworks: dict[str, object] = dict.fromkeys(FRAMEWORK_E2E_KEYS)
    if settings.e2e:
        # After the servers stopped: training starts its own Ray cluster and coordinator.
        print("end to end: lossreduce train, --normalizer torch vs coordinator", flush=True)
        e2e = run_e2e(
            settings.out,
            steps=settings.e2e_steps,
            pairs=settings.e2e_pairs,
            workers=settings.e2e_workers,
            skip=settings.e2e_skip_steps,
            timeout_s=settings.startup_timeout_s + 60.0 * settings.e2e_steps,
        )
        frameworks = run_frameworks_e2e(main_ppo=settings.e2e_main_ppo)
    checks = targets(
        results,
        hierarchical_world_size=settings.hierarchical_nodes * settings.ranks_per_node,
        e2e_ratio=e2e.ratio if e2e is not None else None,
    )
    payload: dict[str, object] = {
        "machine": _machine(),
        "settings": settings.model_dump(mode="json"),
        "results": results,
        "skipped": skipped,
        "ratios": ratios(results),
        "targets": checks,
        "e2e": e2e,
        **frameworks,
        "notes": [
            "latency: from the first rank issuing its contribution to the last rank holding "
            "the sums (perf_counter_ns across processes); rounds/s = 1 / mean latency",
            "server CPU: CPU time of the server process over the measured rounds / contributions; "
            "coordinator = the `lossreduce serve` process, ray-actor = the actor's worker process; "
            "gloo has no server and the TCPStore server runs inside the bench driver (not measured)",
            f"ranks run one per process up to N={settings.max_processes}; above that they are "
            f"simulated as asyncio tasks over {settings.load_processes} processes; gloo always "
            f"runs one process per rank (up to N={settings.gloo_max_processes}); the Ray "
            f"contender's ranks share at most {settings.ray_processes} Ray driver processes; "
            "gloo's and Ray's load processes are their own, the other contenders share theirs",
            f"coordinator-hierarchical: nodes of {settings.ranks_per_node} ranks, each node's ranks "
            "unchanged clients of their node's agent (lossreduce agent), nodes spread over "
            f"{settings.load_processes} load processes; one upstream stream per node; its server "
            "CPU is per rank (the coordinator itself receives one contribution per node)",
            "the coordinator runs as shipped: `lossreduce serve` with its journal and metrics on",
            "coordinator-stream and coordinator-unary run the shipped client: ReductionClient "
            "(blocking) where a rank has its own process, AsyncReductionClient where ranks are "
            "simulated as tasks; bare-stream is a raw grpc.aio stub's ReduceStream against the "
            "coordinator (the floor of any client); bare-echo and hierarchical-echo drive the "
            "echo server (answers each message at once, no round logic) with the bare-stream "
            "and hierarchical loads: grpc.aio's own floor on this machine",
            "client CPU: CPU time of the load processes (every thread) over the measured rounds "
            "/ (rounds x ranks); it includes the idle background threads of the other "
            "contenders' connections in the same process (not gloo's or Ray's, which have "
            "processes of their own)",
        ],
    }
    settings.out.mkdir(parents=True, exist_ok=True)
    write_json(settings.out / "bench.json", payload)
    write_plot(settings.out / "bench.png", results, f"lossreduce bench, {os.cpu_count()} CPUs")
    print(format_table(results, skipped))
    for t in checks:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t.met]
        print(f"target {t.name}: {verdict} ({t.detail})")
    return payload


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_settings_flags(parser, BenchSettings, metavars={"out": "DIR"})
    parser.add_argument(
        "--many-runs",
        action="store_true",
        help="Run the many-runs soak instead (lossreduce.bench.many_runs: one coordinator, "
        "16 concurrent jobs x 16 ranks starting, finishing and reusing names, against one "
        "job of 256 ranks); writes many-runs.json to --out.",
    )
    parser.add_argument(
        "--m2po",
        action="store_true",
        help="Run the global M2PO cut-off benchmark instead (lossreduce.bench.m2po: 8 "
        "gloo ranks x 10^6 tokens, the search through torch.distributed and the coordinator "
        "against an all-gather of every value); writes m2po.json to --out.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"Few rounds ({QUICK_DEFAULTS['rounds']}) at N={','.join(map(str, _QUICK_WORLD_SIZES))} "
        "unless --world-sizes/--rounds/--warmup-rounds say otherwise; finishes in under 2 "
        "minutes.",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    try:
        args = build_parser().parse_args(list(argv))
        settings = parse_settings(
            BenchSettings, args, defaults=QUICK_DEFAULTS if args.quick else None
        )
    except FlagError as err:
        return err.report(PROG)
    if args.many_runs:
        report = run_many_runs(ManyRunsSettings())
        print(format_many_runs(report), flush=True)
        settings.out.mkdir(parents=True, exist_ok=True)
        (settings.out / "many-runs.json").write_text(json.dumps(report, indent=2) + "\n")
        return 0
    if args.m2po:
        from lossreduce.bench.m2po import (
            M2POBenchSettings,
            format_m2po_bench,
            run_m2po_bench,
        )

        m2po = run_m2po_bench(M2POBenchSettings())
        print(format_m2po_bench(m2po), flush=True)
        settings.out.mkdir(parents=True, exist_ok=True)
        (settings.out / "m2po.json").write_text(json.dumps(m2po, indent=2) + "\n")
        return 0
    run_bench(settings)
    return 0
