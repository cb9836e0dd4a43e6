"""Write-ahead journal of finished rounds, in one embedded SQLite file.

Why: a coordinator killed with SIGKILL loses its in-memory round table. Ranks
that had not yet received the answer of a finished round retry it after the
restart; without a record of the outcome they would open a fresh round that
their peers — who got the answer and moved on — never join, and the job
deadlocks. So every finished round's outcome is committed here *before* any
rank is answered, and after a restart a retried contribution is answered from
the journal with the identical outcome.

Design:

- One table keyed by ``(job, group, step)`` holding an opaque ``payload``
  (the encoded outcome; see :mod:`lossreduce.server.journal_store`). The first
  outcome written for a key wins (``INSERT OR IGNORE``): ranks may already
  have it.
- Writes happen on the caller's thread (the coordinator's event loop), inside
  the round table, right before the outcome becomes visible: one small
  transaction per finished round. In WAL mode with ``synchronous="normal"``
  that is one ``write()`` to the WAL, about 25 µs plus the row's encoding.
  The record keeps an 8-byte blake2b digest of every contribution (so a
  conflicting re-send after a restart is recognized), which makes the cost
  O(N) per round: a few µs per contribution, paid on the event loop before
  the round's ranks are answered (``docs/guarantees.md`` has the measured
  figures). A writer thread with group commit would need the servicer to
  await durability; not worth it at this cost.
- Durability: ``synchronous="normal"`` (the default) does not fsync per
  commit, which survives the process being killed (SIGKILL, the OOM killer,
  a crashed Ray actor) because the bytes are in the OS page cache; only a
  kernel crash or power loss can drop the last commits. ``"full"`` fsyncs
  every commit and survives power loss too, at the price of blocking the
  event loop for one fsync per finished round (fine on SSDs, slow on
  network disks).
- Reads: after a restart only rounds finished *before* it can be missing from
  the coordinator's memory, so :meth:`RoundJournal.lookup` touches SQLite only
  for steps at or below the newest step the file held for that group when it
  was opened (the "restart horizon"); every other lookup is a dict miss.
- Retention: every ``compact_every`` writes, one pass deletes rounds beyond the newest
  ``retain_rounds_per_group`` steps of each group and rounds older than
  ``retain_seconds``, so the file stays bounded however long the job runs.
- Claims: one row per ``(job, group)`` names the run holding it
  (:mod:`lossreduce.server.run_claims`), written when a run claims or takes over
  a group and deleted when the claim expires, so a restarted coordinator still
  refuses a colliding run. The retention pass also deletes a claim older than
  ``retain_seconds`` whose group has no round left: at most one row per group
  with rounds, plus the claims of the last ``retain_seconds``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .settings import SERVE_JOURNAL, CoordinatorSettings

__all__ = [
    "JournalError",
    "JournalRecord",
    "JournalSettings",
    "RoundJournal",
]

_log = logging.getLogger(__name__)

_SCHEMA_VERSION = 1
# SQLite integers are signed 64-bit; steps are uint64. Shifting by 2**63 keeps
# every step representable and preserves their order.
_STEP_OFFSET = 1 << 63

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    job TEXT NOT NULL,
    grp TEXT NOT NULL,
    step INTEGER NOT NULL,
    finished_at REAL NOT NULL,
    payload BLOB NOT NULL,
    PRIMARY KEY (job, grp, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS rounds_by_time ON rounds (finished_at);
CREATE TABLE IF NOT EXISTS claims (
    job TEXT NOT NULL,
    grp TEXT NOT NULL,
    run TEXT NOT NULL,
    since REAL NOT NULL,
    step INTEGER NOT NULL,
    floor INTEGER NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (job, grp)
) WITHOUT ROWID;
"""


class JournalError(RuntimeError):
    """The journal file cannot be opened, read or written; the message names the path."""


def _coordinator_default(field: str) -> Any:
    # One default per knob: the coordinator's settings, which `lossreduce serve` documents.
    return CoordinatorSettings.model_fields[field].default


class JournalSettings(BaseModel):
    """Where and how the coordinator journals finished rounds (defaults: the
    coordinator's ``journal_*`` settings, and ``lossreduce serve``'s journal path)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path | None = Field(
        default=SERVE_JOURNAL,
        description=(
            "SQLite file holding finished rounds' outcomes (created if missing); the default is "
            "lossreduce serve's (lossreduce.server.settings.SERVE_JOURNAL, in the working "
            "directory). None turns journaling off: a restarted coordinator then forgets "
            "finished rounds."
        ),
    )
    synchronous: Literal["normal", "full"] = Field(
        default=_coordinator_default("journal_sync"),
        description=(
            "SQLite synchronous mode (WAL journal). 'normal': no fsync per commit; survives the "
            "process being killed, may lose the last commits on power loss. 'full': fsync every "
            "commit; survives power loss, slower."
        ),
    )
    retain_rounds_per_group: int = Field(
        default=_coordinator_default("journal_retain_rounds"),
        ge=1,
        description="Keep at most this many of the newest steps per (job, group); older ones are deleted.",
    )
    retain_seconds: float = Field(
        default=_coordinator_default("journal_retain_s"),
        gt=0,
        description="Delete rounds that finished longer ago than this many seconds; the default "
        "is CoordinatorSettings.journal_retain_s (what `lossreduce serve` uses).",
    )
    compact_every: int = Field(
        default=512,
        ge=1,
        description="Run the retention pass (delete old rounds) after this many rounds were written.",
    )


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One finished round: its key, when it finished (wall clock) and its encoded outcome."""

    job: str
    group: str
    step: int
    finished_at: float
    payload: bytes


class RoundJournal:
    """The journal file: durable writes, restart-horizon reads, retention.

    Use as a context manager or call :meth:`open` / :meth:`close`. One owner
    writes (the coordinator's event loop); a lock makes stray calls from other
    threads (tests, inspection) safe.
    """

    def __init__(self, settings: JournalSettings) -> None:
        if settings.path is None:
            raise ValueError("JournalSettings.path is None: journaling is off, open no journal")
        self.settings = settings
        self.path: Path = settings.path
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._horizon: dict[tuple[str, str], int] = {}
        self._since_compaction = 0
        self._touched: set[tuple[str, str]] = set()
        self.written = 0
        """Records committed since open (a statistic)."""

    # -- lifecycle -------------------------------------------------------

    def open(self) -> RoundJournal:
        """Create or open the file, apply retention, and note the restart horizon."""
        conn = self._connect()
        try:
            self._init_schema(conn)
            self._compact(conn, groups=None, now=time.time())
            self._horizon = {
                (job, grp): step + _STEP_OFFSET
                for job, grp, step in conn.execute(
                    "SELECT job, grp, MAX(step) FROM rounds GROUP BY job, grp"
                )
            }
        except JournalError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            raise JournalError(f"cannot open the round journal {str(self.path)!r}: {exc}") from exc
        self._conn = conn
        _log.info(
            "round journal %s open: %d groups with rounds from before this start",
            self.path,
            len(self._horizon),
        )
        return self

    def close(self) -> None:
        """Apply retention to what this run wrote and close the file."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            try:
                if self._touched:
                    self._compact(conn, groups=self._touched, now=time.time())
            except sqlite3.Error:
                _log.exception("round journal %s: retention pass failed", self.path)
            finally:
                conn.close()

    def __enter__(self) -> RoundJournal:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes ----------------------------------------------------------

    def put(self, record: JournalRecord) -> None:
        """Commit ``record``; returns once SQLite has it (see the module doc on durability).

        The first record of a round wins: writing the same key again is a no-op.
        """
        with self._lock:
            conn = self._require_open()
            try:
                # Autocommit mode: this one statement is one transaction.
                conn.execute(
                    "INSERT OR IGNORE INTO rounds (job, grp, step, finished_at, payload) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (
                        record.job,
                        record.group,
                        record.step - _STEP_OFFSET,
                        record.finished_at,
                        record.payload,
                    ),
                )
            except sqlite3.Error as exc:
                raise JournalError(
                    f"cannot write job {record.job!r} group {record.group!r} step {record.step} "
                    f"to the round journal {str(self.path)!r}: {exc}"
                ) from exc
            self.written += 1
            self._touched.add((record.job, record.group))
            self._since_compaction += 1
            if self._since_compaction >= self.settings.compact_every:
                self._since_compaction = 0
                groups, self._touched = self._touched, set()
                try:
                    self._compact(conn, groups=groups, now=time.time())
                except sqlite3.Error:
                    # Retention is housekeeping: a failed pass retries at the next one.
                    _log.exception("round journal %s: retention pass failed", self.path)

    def put_claim(
        self, job: str, group: str, *, run: str, since: float, step: int, floor: int
    ) -> None:
        """Keep ``run`` (claimed at ``since``, first step ``step``; steps up to ``floor``,
        -1 for none, are the runs it replaced) as the group's holder."""
        self._execute(
            "INSERT OR REPLACE INTO claims (job, grp, run, since, step, floor, written_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (job, group, run, since, step - _STEP_OFFSET, floor, time.time()),
            f"the claim of run {run!r} on job {job!r} group {group!r}",
        )

    def drop_claim(self, job: str, group: str) -> None:
        """Forget the group's holder (its claim expired)."""
        self._execute(
            "DELETE FROM claims WHERE job = ? AND grp = ?",
            (job, group),
            f"the end of the claim on job {job!r} group {group!r}",
        )

    def _execute(self, sql: str, args: tuple[object, ...], what: str) -> None:
        with self._lock:
            try:
                self._require_open().execute(sql, args)
            except sqlite3.Error as exc:
                raise JournalError(
                    f"cannot write {what} to the round journal {str(self.path)!r}: {exc}"
                ) from exc

    # -- reads -----------------------------------------------------------

    def claims(self) -> list[tuple[str, str, str, float, int, int]]:
        """Every kept claim as ``(job, group, run, since, newest_step, floor)``; the newest
        step is the later of the claim's first step and the group's newest journaled round."""
        with self._lock:
            rows = (
                self._require_open()
                .execute(
                    "SELECT c.job, c.grp, c.run, c.since, MAX(c.step, "
                    "COALESCE((SELECT MAX(r.step) FROM rounds r "
                    "WHERE r.job = c.job AND r.grp = c.grp), c.step)), c.floor FROM claims c"
                )
                .fetchall()
            )
        return [
            (j, g, run, since, step + _STEP_OFFSET, floor) for j, g, run, since, step, floor in rows
        ]

    def lookup(self, job: str, group: str, step: int) -> bytes | None:
        """The payload of a round finished before this journal was opened, or None.

        Rounds finished since the open are the coordinator's own to remember,
        so only steps within the restart horizon of their group reach SQLite.
        """
        horizon = self._horizon.get((job, group))
        if horizon is None or step > horizon:
            return None
        with self._lock:
            row = (
                self._require_open()
                .execute(
                    "SELECT payload FROM rounds WHERE job = ? AND grp = ? AND step = ?",
                    (job, group, step - _STEP_OFFSET),
                )
                .fetchone()
            )
        return None if row is None else bytes(row[0])

    def records(self, job: str | None = None) -> list[JournalRecord]:
        """Every retained record (of one job), ordered by job, group and step; for inspection."""
        sql = "SELECT job, grp, step, finished_at, payload FROM rounds"
        args: tuple[str, ...] = ()
        if job is not None:
            sql += " WHERE job = ?"
            args = (job,)
        sql += " ORDER BY job, grp, step"
        with self._lock:
            rows = self._require_open().execute(sql, args).fetchall()
        return [
            JournalRecord(job=j, group=g, step=s + _STEP_OFFSET, finished_at=t, payload=bytes(p))
            for j, g, s, t, p in rows
        ]

    # -- internals -------------------------------------------------------

    def _require_open(self) -> sqlite3.Connection:
        if self._conn is None:
            raise JournalError(f"the round journal {str(self.path)!r} is not open")
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Autocommit mode: transactions are opened explicitly where several statements need one.
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=10.0
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self.settings.synchronous.upper()}")
            # Truncate the WAL back to 8 MiB after checkpoints so the files stay bounded.
            conn.execute("PRAGMA journal_size_limit=8388608")
        except (OSError, sqlite3.Error) as exc:
            # A file that is no database fails at the first statement: close what opened
            # (Python 3.13 warns of every connection left to the collector).
            if conn is not None:
                conn.close()
            raise JournalError(f"cannot open the round journal {str(self.path)!r}: {exc}") from exc
        return conn

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version not in (0, _SCHEMA_VERSION):
            raise JournalError(
                f"the round journal {str(self.path)!r} has schema version {version}; "
                f"this coordinator reads version {_SCHEMA_VERSION}"
            )
        conn.executescript(_SCHEMA)
        conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    def _compact(
        self, conn: sqlite3.Connection, *, groups: Iterable[tuple[str, str]] | None, now: float
    ) -> None:
        if groups is None:
            groups = conn.execute("SELECT DISTINCT job, grp FROM rounds").fetchall()
        keep = self.settings.retain_rounds_per_group
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "DELETE FROM rounds WHERE finished_at < ?", (now - self.settings.retain_seconds,)
            )
            conn.execute(
                "DELETE FROM claims WHERE written_at < ? AND NOT EXISTS (SELECT 1 FROM rounds r "
                "WHERE r.job = claims.job AND r.grp = claims.grp)",
                (now - self.settings.retain_seconds,),
            )
            for job, grp in groups:
                # The step of the oldest round to keep; everything older goes.
                row = conn.execute(
                    "SELECT step FROM rounds WHERE job = ? AND grp = ? "
                    "ORDER BY step DESC LIMIT 1 OFFSET ?",
                    (job, grp, keep - 1),
                ).fetchone()
                if row is not None:
                    conn.execute(
                        "DELETE FROM rounds WHERE job = ? AND grp = ? AND step < ?",
                        (job, grp, row[0]),
                    )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
