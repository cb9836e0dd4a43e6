"""``lossreduce bench --many-runs``: one coordinator, many runs at once, measured.

One ``lossreduce serve`` (its own process, journal and per-job tokens on, a
short idle TTL) first serves a single job of ``jobs x ranks`` ranks, then
``jobs`` concurrent job slots of ``ranks`` ranks each. Every slot runs one run
after another, so jobs start and finish throughout, and a slot's next run
either takes a fresh job name, resumes the previous name under a new run id
past its last step (after a colliding run at step 0 is refused on every rank),
or reuses the name from step 0 once the coordinator released it (the TTL). The
driver checks every answer against its own run's sums (no round answered to
the wrong run, nothing lost), that a job's token cannot contribute to another
job mid-round, and samples the server's RSS, metric series and journal.

Rank values encode slot, run and step (exact integers), so an answer from any
other run's round has another sum.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import status_pb2
from pydantic import BaseModel, ConfigDict, Field

from lossreduce.errors import AuthenticationError, LossReduceError, RunConflictError
from lossreduce.ports import free_port
from lossreduce.status_codec import from_status
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc

from .servers import CoordinatorProcess
from .stats import percentile

__all__ = ["ManyRunsSettings", "format_many_runs", "run_many_runs"]

_GROUP = "actor"
_CALL_TIMEOUT_S = 60.0


class ManyRunsSettings(BaseModel):
    """The many-runs soak: sizes, the idle TTL it waits out, and its seed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    jobs: int = Field(default=16, ge=2, description="Concurrent job slots.")
    ranks: int = Field(default=16, ge=1, description="Ranks of every job.")
    rounds: int = Field(default=2000, ge=1, description="Rounds over all slots, at least.")
    run_rounds: int = Field(
        default=30, ge=2, description="Rounds of one run (each slot runs several)."
    )
    single_job_rounds: int = Field(
        default=100, ge=1, description="Rounds of the single job of jobs x ranks ranks."
    )
    idle_ttl_s: float = Field(
        default=3.0, gt=0, description="The coordinator's idle_group_ttl_s for the soak."
    )
    round_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="The coordinator's round timeout; it also sweeps idle groups every "
        "min(5 s, this), which the soak waits out before reusing a name.",
    )
    seed: int = Field(default=0, description="Seed of the slots' plans.")


@dataclass
class _Tally:
    latencies_s: list[float] = field(default_factory=list)
    rounds: int = 0
    wrong: int = 0
    """Answers whose key or sums are not the run's own."""
    lost: int = 0
    """Calls that should have succeeded and did not."""
    conflicts_refused: int = 0
    """Colliding runs refused on every one of their ranks."""
    conflicts_leaked: int = 0
    """Colliding runs that got any answer on any rank."""
    token_refused: int = 0
    token_leaked: int = 0
    name_reuses: int = 0
    resumes: int = 0


def _values(ranks: int, slot: int, run: int, step: int) -> list[float]:
    base = float(slot * 1_000_000 + run * 10_000 + step)  # exact in a double
    return [base * 16 + r for r in range(ranks)]


@dataclass(frozen=True)
class _Run:
    """One run of one job as the driver sends it: the job's channel and token."""

    stub: pb_grpc.ReductionCoordinatorStub
    token: str
    job: str
    run: str

    def request(self, step: int, rank: int, world: int, value: float) -> pb.ReduceRequest:
        request = pb.ReduceRequest(rank=rank, world_size=world, run=self.run)
        request.round.job, request.round.group, request.round.step = self.job, _GROUP, step
        request.partials.add(term="pg", value=value, contract="mean:token_mean")
        return request

    async def call(
        self, request: pb.ReduceRequest, token: str | None = None
    ) -> pb.ReduceResponse | LossReduceError:
        bearer = (("authorization", f"Bearer {token or self.token}"),)
        try:
            response: pb.ReduceResponse = await self.stub.Reduce(
                request, metadata=bearer, timeout=_CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            return from_status(_status_of(err))
        return response


def _status_of(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    return status_pb2.Status(code=err.code().value[0], message=err.details() or "")


async def _round(run: _Run, step: int, values: Sequence[float], tally: _Tally) -> None:
    """One round of one run: every rank at once; every answer checked against its sums."""
    world = len(values)
    expected = sum(values)  # integers: exact
    start = time.perf_counter()
    answers = await asyncio.gather(
        *(run.call(run.request(step, r, world, v)) for r, v in enumerate(values))
    )
    tally.latencies_s.append(time.perf_counter() - start)
    tally.rounds += 1
    for answer in answers:
        if isinstance(answer, LossReduceError):
            tally.lost += 1
        elif (
            (answer.round.job, answer.round.step) != (run.job, step)
            or len(answer.normalizers) != 1
            or answer.normalizers[0].value != expected
        ):
            tally.wrong += 1


async def _collide(run: _Run, ranks: int, tally: _Tally) -> None:
    """A new run at step 0 of a job whose holder is past it: refused on every rank."""
    collider = _Run(run.stub, run.token, run.job, f"collider-of-{run.run}")
    answers = await asyncio.gather(
        *(collider.call(collider.request(0, r, ranks, 1.0)) for r in range(ranks))
    )
    if all(isinstance(a, RunConflictError) for a in answers):
        tally.conflicts_refused += 1
    else:
        tally.conflicts_leaked += 1


async def _foreign(run: _Run, foreign_token: str, step: int, ranks: int, tally: _Tally) -> None:
    """Another job's token contributing rank 0 to this run's live round: refused."""
    answer = await run.call(run.request(step, 0, ranks, 1e9), foreign_token)
    if isinstance(answer, AuthenticationError):
        tally.token_refused += 1
    else:
        tally.token_leaked += 1


async def _slot(
    target: str, slot: int, tokens: list[str], settings: ManyRunsSettings, tally: _Tally
) -> None:
    rng = random.Random(settings.seed * 1000 + slot)
    quota = -(-settings.rounds // settings.jobs)
    await asyncio.sleep(rng.random() * 2.0)  # slots start (and so finish) staggered
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        token, foreign = tokens[slot], tokens[(slot + 1) % len(tokens)]
        job, next_step, run_index, done = f"slot{slot}-job0", 0, 0, 0
        while done < quota:
            run = _Run(stub, token, job, f"slot{slot}-run{run_index}")
            count = min(settings.run_rounds, quota - done)
            for i, step in enumerate(range(next_step, next_step + count)):
                values = _values(settings.ranks, slot, run_index, step)
                work = [_round(run, step, values, tally)]
                if i == 1:
                    work.append(_foreign(run, foreign, step, settings.ranks, tally))
                await asyncio.gather(*work)
            done += count
            if done >= quota:
                break
            last = next_step + count - 1
            run_index += 1
            # Reuses wait out the TTL (the slot idles meanwhile): one run in five.
            kind = rng.choices(("fresh", "resume", "reuse"), weights=(2, 2, 1))[0]
            if kind == "fresh":
                job, next_step = f"slot{slot}-job{run_index}", 0
            elif kind == "resume":
                await _collide(run, settings.ranks, tally)
                next_step = last + 1
                tally.resumes += 1
            else:
                # Reuse the name from step 0 once the coordinator let go of it.
                await asyncio.sleep(settings.idle_ttl_s + _sweep_s(settings) + 1.0)
                next_step = 0
                tally.name_reuses += 1


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _series(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(1 for line in text.splitlines() if 'job="' in line and not line.startswith("#"))


def _journal(path: Path) -> dict[str, int]:
    sizes = {"journal_bytes": sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        (sizes["journal_rounds"],) = conn.execute("SELECT COUNT(*) FROM rounds").fetchone()
        (sizes["journal_claims"],) = conn.execute("SELECT COUNT(*) FROM claims").fetchone()
    return sizes


def _summary(tally: _Tally, wall_s: float, ranks: int) -> dict[str, float | int]:
    lat = sorted(tally.latencies_s)
    return {
        "rounds": tally.rounds,
        "ranks_per_round": ranks,
        "wall_s": round(wall_s, 2),
        "rounds_per_s": round(tally.rounds / wall_s, 1),
        "contributions_per_s": round(tally.rounds * ranks / wall_s, 1),
        "p50_ms": round(percentile(lat, 50) * 1e3, 2),
        "p99_ms": round(percentile(lat, 99) * 1e3, 2),
    }


def _sweep_s(settings: ManyRunsSettings) -> float:
    # The coordinator sweeps idle groups every min(5 s, round timeout) (server/app.py).
    return min(5.0, settings.round_timeout_s)


async def _idle(settings: ManyRunsSettings) -> None:
    await asyncio.sleep(settings.idle_ttl_s + 2 * _sweep_s(settings) + 1.0)


async def _drive(
    server: CoordinatorProcess,
    metrics_url: str,
    journal: Path,
    tokens: list[str],
    settings: ManyRunsSettings,
) -> dict[str, object]:
    report: dict[str, object] = {}
    world = settings.jobs * settings.ranks
    single = _Tally()
    async with grpc.aio.insecure_channel(server.target) as channel:
        run = _Run(pb_grpc.ReductionCoordinatorStub(channel), tokens[-1], "single-job", "single")
        started = time.perf_counter()
        for step in range(settings.single_job_rounds):
            await _round(run, step, _values(world, settings.jobs, 0, step), single)
        report["single_job"] = _summary(single, time.perf_counter() - started, world)
    await _idle(settings)
    report["baseline"] = {"rss_bytes": _rss_bytes(server.pid), "series": _series(metrics_url)}

    tally = _Tally()
    peak: dict[str, int] = {"rss_bytes": 0, "series": 0}

    async def sample() -> None:
        while True:
            peak["rss_bytes"] = max(peak["rss_bytes"], _rss_bytes(server.pid))
            peak["series"] = max(peak["series"], _series(metrics_url))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    started = time.perf_counter()
    await asyncio.gather(
        *(_slot(server.target, s, tokens, settings, tally) for s in range(settings.jobs))
    )
    wall = time.perf_counter() - started
    sampler.cancel()
    peak.update(_journal(journal))
    report["many_runs"] = {
        **_summary(tally, wall, settings.ranks),
        "jobs": settings.jobs,
        "wrong_answers": tally.wrong,
        "lost_answers": tally.lost,
        "collisions_refused_on_every_rank": tally.conflicts_refused,
        "collisions_leaked": tally.conflicts_leaked,
        "foreign_token_refused": tally.token_refused,
        "foreign_token_leaked": tally.token_leaked,
        "resumes": tally.resumes,
        "name_reuses": tally.name_reuses,
    }
    report["peak"] = dict(peak)
    await _idle(settings)
    report["after_idle"] = {
        "rss_bytes": _rss_bytes(server.pid),
        "series": _series(metrics_url),
        **_journal(journal),
    }
    return report


def run_many_runs(settings: ManyRunsSettings) -> dict[str, object]:
    """Run the soak against a fresh ``lossreduce serve``; the figures as a dict."""
    import secrets

    tokens = [secrets.token_urlsafe(24) for _ in range(settings.jobs + 1)]
    quota = -(-settings.rounds // settings.jobs)
    with tempfile.TemporaryDirectory(prefix="lossreduce-many-runs-") as tmp:
        token_file = Path(tmp) / "tokens"
        lines = [
            f"{tokens[s]}  " + ",".join(f"slot{s}-job{i}" for i in range(quota + 1))
            for s in range(settings.jobs)
        ]
        token_file.write_text("\n".join([*lines, f"{tokens[-1]}  single-job"]) + "\n")
        token_file.chmod(0o600)
        journal = Path(tmp) / "journal.sqlite3"
        metrics_port = free_port()
        server = CoordinatorProcess(
            extra_args=[
                "--metrics-port",
                str(metrics_port),
                "--journal",
                str(journal),
                "--journal-retain-s",
                str(settings.idle_ttl_s),
                "--idle-group-ttl-s",
                str(settings.idle_ttl_s),
                "--round-timeout-s",
                str(settings.round_timeout_s),
                "--token-file",
                str(token_file),
            ]
        )
        try:
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            report = asyncio.run(_drive(server, metrics_url, journal, tokens, settings))
        finally:
            server.stop()
    report["settings"] = settings.model_dump()
    return report


def format_many_runs(report: dict[str, object]) -> str:
    """The soak's figures as lines of text (what ``lossreduce bench --many-runs`` prints)."""
    lines = []
    for name in ("single_job", "many_runs"):
        figures = report[name]
        assert isinstance(figures, dict)
        lines.append(
            f"{name:10}  {figures['rounds']:5} rounds x {figures['ranks_per_round']:3} ranks  "
            f"{figures['rounds_per_s']:8.1f} rounds/s  {figures['contributions_per_s']:9.1f} "
            f"contributions/s  p50 {figures['p50_ms']:7.2f} ms  p99 {figures['p99_ms']:7.2f} ms"
        )
    many = report["many_runs"]
    assert isinstance(many, dict)
    lines.append(
        "checks: "
        + ", ".join(
            f"{key}={many[key]}"
            for key in (
                "wrong_answers",
                "lost_answers",
                "collisions_refused_on_every_rank",
                "collisions_leaked",
                "foreign_token_refused",
                "foreign_token_leaked",
                "resumes",
                "name_reuses",
            )
        )
    )
    for phase in ("baseline", "peak", "after_idle"):
        lines.append(f"{phase:10}  {report[phase]}")
    return "\n".join(lines)
