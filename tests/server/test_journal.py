"""The SQLite round journal: write-ahead commits, restart lookups, retention."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lossreduce.server.journal import (
    JournalError,
    JournalRecord,
    JournalSettings,
    RoundJournal,
)

U64_MAX = (1 << 64) - 1


def _record(
    step: int, job: str = "j", group: str = "actor", at: float | None = None
) -> JournalRecord:
    return JournalRecord(
        job=job,
        group=group,
        step=step,
        finished_at=time.time() if at is None else at,
        payload=f"{job}/{group}/{step}".encode(),
    )


def _journal(path: Path, **overrides: object) -> RoundJournal:
    return RoundJournal(JournalSettings.model_validate({"path": path, **overrides}))


def test_records_committed_before_a_restart_are_found_after_it(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with _journal(path) as journal:
        for step in (0, 1, 7, U64_MAX):
            journal.put(_record(step))
        journal.put(_record(3, job="other", group="critic"))
    with _journal(path) as journal:
        for step in (0, 1, 7, U64_MAX):
            assert journal.lookup("j", "actor", step) == f"j/actor/{step}".encode()
        assert journal.lookup("other", "critic", 3) == b"other/critic/3"
        assert journal.lookup("j", "actor", 2) is None
        assert journal.lookup("j", "critic", 0) is None
        assert journal.lookup("nobody", "actor", 0) is None


def test_lookup_only_reaches_rounds_from_before_the_open(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with _journal(path) as journal:
        journal.put(_record(5))
    with _journal(path) as journal:
        journal.put(_record(4))
        journal.put(_record(6))
        # Step 4 is within the horizon (<= 5): SQLite answers it.
        assert journal.lookup("j", "actor", 4) == b"j/actor/4"
        # Step 6 finished after this open: the coordinator itself remembers it.
        assert journal.lookup("j", "actor", 6) is None
        assert [r.step for r in journal.records()] == [4, 5, 6]


def test_the_first_outcome_written_for_a_round_wins(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with _journal(path) as journal:
        journal.put(_record(1))
        journal.put(JournalRecord("j", "actor", 1, time.time(), b"second"))
    with _journal(path) as journal:
        assert journal.lookup("j", "actor", 1) == b"j/actor/1"


def test_retention_keeps_the_newest_steps_of_each_group(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with _journal(path, retain_rounds_per_group=50, compact_every=20) as journal:
        for step in range(1_000):
            journal.put(_record(step))
            journal.put(_record(step, group="critic"))
    with _journal(path, retain_rounds_per_group=50) as journal:
        for group in ("actor", "critic"):
            steps = [r.step for r in journal.records() if r.group == group]
            assert steps == list(range(950, 1_000))


def test_retention_drops_rounds_older_than_the_age_limit(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    now = time.time()
    with _journal(path) as journal:
        journal.put(_record(0, at=now - 7200))
        journal.put(_record(1, at=now))
    with _journal(path, retain_seconds=3600) as journal:
        assert [r.step for r in journal.records()] == [1]


def test_the_file_stays_bounded_while_rounds_keep_finishing(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"

    def files_size() -> int:
        # Fold the WAL into the main file first, as SQLite's auto-checkpoint does every 4 MiB.
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        return sum(p.stat().st_size for p in tmp_path.iterdir())

    sizes = []
    with _journal(path, retain_rounds_per_group=200, compact_every=100) as journal:
        for chunk in range(6):
            for i in range(2_000):
                journal.put(_record(chunk * 2_000 + i))
            sizes.append(files_size())
        assert len(journal.records()) <= 200 + 100
    # Pages freed by retention are reused: after the first bursts the size stops growing.
    assert max(sizes[2:]) <= 1.5 * sizes[1], sizes


def test_an_unreadable_file_is_reported_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "garbage.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match=r"garbage\.sqlite3"):
        _journal(path).open()


def test_a_journal_from_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    with pytest.raises(JournalError, match="schema version 99"):
        _journal(path).open()


def test_writing_to_a_closed_journal_names_the_file(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j.sqlite3").open()
    journal.close()
    journal.close()  # closing twice is harmless
    with pytest.raises(JournalError, match=r"j\.sqlite3.*not open"):
        journal.put(_record(0))


def test_settings_without_a_path_open_no_journal() -> None:
    with pytest.raises(ValueError, match="journaling is off"):
        RoundJournal(JournalSettings(path=None))


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from lossreduce.server.journal import JournalRecord, JournalSettings, RoundJournal

    journal = RoundJournal(JournalSettings(path=Path(sys.argv[1]))).open()
    step = 0
    while True:
        journal.put(JournalRecord("j", "actor", step, time.time(), b"outcome-%d" % step))
        # Only now may a rank be answered: announce the commit.
        print(step, flush=True)
        step += 1
    """
)


def test_every_acknowledged_record_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    with _journal(path) as journal:
        for step in range(acknowledged + 1):
            assert journal.lookup("j", "actor", step) == b"outcome-%d" % step
