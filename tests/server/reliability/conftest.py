"""A real ``lossreduce serve`` child process that tests can SIGKILL, SIGTERM and restart.

- ``serve_factory(journal=..., args=[...])`` starts one on a free loopback
  port (journal in the test's tmp dir unless told otherwise) and returns a
  :class:`ServeProcess`; every one started is killed when the test ends.
- ``ServeProcess.kill()`` is SIGKILL, ``.terminate()`` SIGTERM (drain),
  ``.restart()`` starts it again on the same port and journal,
  ``.rss_bytes()`` reads its resident memory, ``.metrics()`` scrapes /metrics.
"""

from __future__ import annotations

import math
import random
import re
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from lossreduce.bench.servers import start_serve
from lossreduce.client import ClientSettings
from lossreduce.contribution import Contribution
from lossreduce.ports import free_port
from lossreduce.v2 import coordinator_pb2 as pb

STARTUP_TIMEOUT_S = 60.0


class ServeProcess:
    """One ``lossreduce serve`` child; restartable on the same port and journal."""

    def __init__(self, workdir: Path, journal: Path | None, args: Sequence[str]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.metrics_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.journal = journal
        self.args = [
            "--metrics-port",
            str(self.metrics_port),
            "--journal",
            "none" if journal is None else str(journal),
            *args,
        ]
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "serve.log"

    def start(self) -> ServeProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log_path.open("ab") as log:
            self.proc = start_serve(
                self.port,
                self.args,
                log=log,
                log_text=self.log,
                cwd=self.workdir,
                timeout_s=STARTUP_TIMEOUT_S,
            )
        self.starts += 1
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; the journal is all that survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait for the drain to finish; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def restart(self) -> ServeProcess:
        self.kill()
        return self.start()

    def rss_bytes(self) -> int:
        text = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
        assert match is not None
        return int(match.group(1)) * 1024

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text: str = reply.read().decode()
            return text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of one metric's samples whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith((name + "{", name + " ")):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


ServeFactory = Callable[..., ServeProcess]


@pytest.fixture
def serve_factory(tmp_path: Path) -> Iterator[ServeFactory]:
    started: list[ServeProcess] = []

    def make(*, journal: Path | str | None = "default", args: Sequence[str] = ()) -> ServeProcess:
        path = tmp_path / "journal.sqlite3" if journal == "default" else journal
        assert path is None or isinstance(path, Path)
        proc = ServeProcess(tmp_path, path, args)
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        proc.kill()


class Workload:
    """Deterministic partials of every rank at every step, and the answers they must get.

    Partials are random doubles (plus exact zeros), so a contribution counted
    twice or lost changes the sum: no double count can hide.
    """

    terms = ("tokens", "groups", "tiny")
    contracts: ClassVar[dict[str, str]] = {
        "tokens": "mean:token_mean",
        "groups": "mean:prompt_mean",
        "tiny": "sum:constant:divisor=1",
    }

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def partials(self, rank: int, step: int) -> dict[str, float]:
        rng = random.Random(f"{self.seed}/{rank}/{step}")
        return {
            "tokens": float(rng.randrange(1, 4096)),
            "groups": rng.uniform(0.0, 1e6),
            "tiny": rng.uniform(0.0, 1e-300) if rank % 3 else 0.0,
        }

    def request(self, job: str, rank: int, world_size: int, step: int) -> pb.ReduceRequest:
        """The raw ``ReduceRequest`` of one rank at one step (group ``actor``)."""
        partials = self.partials(rank, step)
        contribution = Contribution(
            rank,
            world_size,
            tuple(partials),
            tuple(partials.values()),
            tuple(self.contracts[term] for term in partials),
        )
        return contribution.request(pb.RoundKey(job=job, group="actor", step=step))

    def expected(self, world_size: int, step: int) -> dict[str, float]:
        """What an uninterrupted coordinator answers: ``math.fsum`` in rank order, per term."""
        rows = [self.partials(rank, step) for rank in range(world_size)]
        return {term: math.fsum(row[term] for row in rows) for term in self.terms}


@pytest.fixture
def workload() -> Workload:
    return Workload(seed=20261202)


@pytest.fixture
def retrying() -> Callable[..., ClientSettings]:
    """Client settings that ride out coordinator restarts (overrides as keywords)."""

    def make(**overrides: object) -> ClientSettings:
        return ClientSettings.model_validate(
            {
                "retry_budget_s": 120.0,
                "initial_backoff_s": 0.05,
                "max_backoff_s": 0.5,
                "call_timeout_s": 60.0,
                "token": None,
                **overrides,
            }
        )

    return make
