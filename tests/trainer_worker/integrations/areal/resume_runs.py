"""What ``test_areal_resume.py`` launches: an external ``lossreduce serve``, an AReaL run
SIGKILLed after a step, and the stats a launch printed.

- :func:`start_serve_process` starts ``lossreduce serve`` on a free loopback port
  with a journal file; :class:`Serve` reads the rounds and run claims back from it.
- :func:`start_halted` launches ``grpo_launch.py`` (its import turned to
  ``halting_trainer.HaltingPPOTrainer``) under ``torchrun`` like
  ``trainer_loop.run_loop`` does, and returns once every rank has written its
  checkpoint of the halting step and stopped; :meth:`Halted.kill` then SIGKILLs
  torchrun's process group and each rank's own (torchrun starts every rank in a
  session of its own, so killing its group alone would leave them running).
- :func:`clear_name_records` drops a launch's name_resolve records before its relaunch,
  as AReaL's launchers do; :func:`checkpointed` and :func:`drawn` read the step and the
  data loader positions of its last recover checkpoint, :func:`received` the weights its
  rollout server received.
- :func:`step_stats` reads the per-step stats tables AReaL's ``StatsLogger`` printed.

The killed run's files (checkpoints, AReaL's recover info) are under
``work/fileroot``, where ``trainer_loop.launch(..., work)`` puts a relaunch's.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lossreduce.bench.servers import start_serve
from lossreduce.ports import free_port
from lossreduce.server.journal import _STEP_OFFSET
from tests.trainer_worker.integrations.areal import trainer_loop
from tests.trainer_worker.integrations.areal.halting_trainer import HALT_AFTER_ENV, HALT_DIR_ENV

RECOVER = ("recover.mode=on", "recover.freq_steps=1")
"""AReaL's own settings for a resumable run: a recover checkpoint after every step, and
recovery from the latest one at launch (``mode=on``; a run without one starts fresh)."""

HALTING_IMPORT = (
    "from tests.trainer_worker.integrations.areal.halting_trainer import "
    "HaltingPPOTrainer as PPOTrainer"
)
_HALT_TIMEOUT_S = 480.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL = re.compile(r"│\s*([\w/.\-]+)\s*│\s*([-+0-9.eE]+|nan|inf|-inf)\s*(?=│)")
_STEP = re.compile(r"Train step (\d+)/\d+ done\.")


@dataclass
class Serve:
    """One ``lossreduce serve`` child with a journal file."""

    process: subprocess.Popen[bytes]
    target: str
    journal: Path
    log: Path

    def _query(self, sql: str, args: tuple[str, ...]) -> list[tuple[Any, ...]]:
        # Read-only beside the running server (the journal is SQLite in WAL mode).
        with closing(sqlite3.connect(f"file:{self.journal}?mode=ro", uri=True)) as conn:
            return list(conn.execute(sql, args).fetchall())

    def rounds(self, job: str) -> dict[int, bytes]:
        """Step -> journaled outcome of every finished round of ``job``."""
        rows = self._query("SELECT step, payload FROM rounds WHERE job = ?", (job,))
        return {int(step) + _STEP_OFFSET: bytes(payload) for step, payload in rows}

    def holders(self, job: str) -> dict[str, str]:
        """Group -> the run holding ``job``'s claim on it."""
        with_claims = self._query("SELECT grp, run FROM claims WHERE job = ?", (job,))
        return {str(group): str(run) for group, run in with_claims}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_serve_process(work: Path) -> Serve:
    """``lossreduce serve`` on a free loopback port, journaling to ``work/journal.sqlite3``."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    journal = work / "journal.sqlite3"
    log_path = work / "serve.log"
    args = ["--metrics-port", "off", "--journal", str(journal)]
    with log_path.open("ab") as log:
        process = start_serve(
            port, args, log=log, log_text=log_path.read_text, cwd=work, timeout_s=120
        )
    return Serve(process, f"127.0.0.1:{port}", journal, log_path)


def round_normalizers(payload: bytes) -> dict[str, float]:
    """The normalizers of a completed round from its journal payload (exact floats)."""
    from lossreduce.server.journal_store import decode_outcome
    from lossreduce.server.outcomes import OutcomeKind, RoundKey

    outcome = decode_outcome(RoundKey("job", "group", 0), payload)
    assert outcome.kind is OutcomeKind.COMPLETED, outcome
    return {n.term: n.value for n in outcome.normalizers}


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # The command name (in parentheses) may hold spaces: the fields follow its end.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class Halted:
    """A launch stopped after its halting step's checkpoint (see the module docstring)."""

    process: subprocess.Popen[bytes]
    server: trainer_loop.RolloutServer
    work: Path
    output: IO[bytes]
    output_path: Path

    def kill(self) -> dict[str, Any]:
        """SIGKILL the launch (torchrun and every rank), then stop its rollout server;
        returns what the server served."""
        groups = set()
        for pid in (self.process.pid, *_descendants(self.process.pid)):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue  # exited (torchrun itself, when a rank failed)
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                continue
        self.process.wait(timeout=60)
        try:
            return self.server.log()
        finally:
            self.server.stop()
            self.output.close()

    def text(self) -> str:
        return _ANSI.sub("", self.output_path.read_text(errors="replace"))


def _halting_script(work: Path) -> Path:
    text = trainer_loop.LAUNCH.read_text()
    assert trainer_loop.LOSSREDUCE_IMPORT in text
    script = work / "grpo_halting.py"
    script.write_text(text.replace(trainer_loop.LOSSREDUCE_IMPORT, HALTING_IMPORT))
    return script


def start_halted(
    work: Path,
    *,
    model: Path,
    prompts: Path,
    env: dict[str, str],
    halt_after: int,
    ranks: int = 2,
    overrides: tuple[str, ...] = (),
) -> Halted:
    """``grpo_launch.py`` with the halting trainer, against its own rollout server,
    returned once every rank has halted after step ``halt_after`` (1-based)."""
    halted = work / "halted"
    halted.mkdir(parents=True)
    server = trainer_loop.start_server(
        model, free_port(), 0, halted / "received", halted / "server.log"
    )
    marks = halted / "marks"
    marks.mkdir()
    output_path = halted / "torchrun.log"
    output = output_path.open("wb")
    # The fileroot and name records go where trainer_loop.run_loop puts them for a launch
    # in `work`: the relaunch's.
    args, full_env = trainer_loop.torchrun_command(
        _halting_script(halted),
        work,
        model=model,
        prompts=prompts,
        server=server.address,
        master_port=free_port(),
        env={HALT_AFTER_ENV: str(halt_after), HALT_DIR_ENV: str(marks), **env},
        ranks=ranks,
        overrides=overrides,
    )
    process = subprocess.Popen(
        args,
        cwd=work,
        env=full_env,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, which kill() signals
    )
    launch = Halted(process, server, work, output, output_path)
    deadline = time.monotonic() + _HALT_TIMEOUT_S
    while len(list(marks.iterdir())) < ranks:
        if process.poll() is not None or time.monotonic() > deadline:
            why = (
                f"exited with {process.returncode}"
                if process.poll() is not None
                else f"did not halt within {_HALT_TIMEOUT_S:.0f} s"
            )
            launch.kill()
            raise RuntimeError(f"the halting launch {why}:\n{launch.text()[-6000:]}")
        time.sleep(0.5)
    return launch


def received(work: Path) -> dict[int, dict[str, Any]]:
    """Version -> the state dict the rollout server of a launch in ``work`` received."""
    import torch

    found = sorted((work / "received").glob("v*.pt"))
    return {int(p.stem[1:]): torch.load(p, weights_only=True) for p in found}


def clear_name_records(work: Path) -> None:
    """Drop the name_resolve records of a launch in ``work``, as AReaL's launchers do at
    every launch (``name_resolve.clear_subtree`` of the trial). ``torchrun`` run directly
    does not, and a killed run's records (its disk weight-update entries, numbered from
    version 0) would make the relaunch's first weight update fail with AReaL's
    ``NameEntryExistsError``."""
    shutil.rmtree(work / "name_resolve", ignore_errors=True)


def checkpointed(work: Path) -> dict[str, int]:
    """Epoch, step within it and global step (0-based) of the last recover checkpoint
    AReaL wrote for a launch in ``work`` (its ``recover_info/step_info.json``)."""
    (found,) = (work / "fileroot" / "checkpoints").glob("*/*/*/recover_info/step_info.json")
    info = json.loads(found.read_text())
    return {key: int(info[key]) for key in ("epoch", "epoch_step", "global_step")}


def drawn(work: Path) -> list[int]:
    """Prompts each rank's data loader had yielded at the last recover checkpoint of a
    launch in ``work`` (its ``recover_info/dataloader_info.pkl``, one state per rank)."""
    (found,) = (work / "fileroot" / "checkpoints").glob("*/*/*/recover_info/dataloader_info.pkl")
    with found.open("rb") as data:
        states = pickle.load(data)  # written by this test's own launch
    return [int(state["_sampler_iter_state"]["samples_yielded"]) for state in states]


def step_stats(stdout: str) -> dict[int, dict[str, float]]:
    """Global step (1-based) -> the stats AReaL's ``StatsLogger`` printed for it."""
    text = _ANSI.sub("", stdout)
    marks = list(_STEP.finditer(text))
    stats = {}
    for index, mark in enumerate(marks):
        end = marks[index + 1].start() if index + 1 < len(marks) else len(text)
        table = text[mark.end() : end]
        stats[int(mark.group(1))] = {k: float(v) for k, v in _CELL.findall(table)}
    return stats
