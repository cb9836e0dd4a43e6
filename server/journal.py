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
  (the encoded outcome; see ``lossreduce.server.journal_codec``). The first
  outcome written for a key wins (``INSERT OR IGNORE``): ranks may already
  have it.
- Rounds finish at a high rate, so writes never run on the event loop: one
  writer thread drains a queue and commits everything queued so far in one
  transaction (group commit). :meth:`RoundJournal.write` awaits that commit.
- Durability: WAL mode. ``synchronous="normal"`` (the default) commits to the
  WAL without fsync, which survives the process being killed (SIGKILL, OOM
  killer, a crashed Ray actor) because the bytes are in the OS page cache;
  only a kernel crash or power loss can drop the last commits. ``"full"``
  fsyncs every commit (every batch) and survives power loss too.
- Reads: after a restart only rounds finished *before* it can be missing from
  the coordinator's memory, so :meth:`RoundJournal.lookup` touches SQLite only
  for steps at or below the newest step the file held for that group when it
  was opened (the "restart horizon"); every other lookup is a dict miss.
- Retention: the writer thread deletes rounds beyond the newest
  ``retain_rounds_per_group`` steps of each group and rounds older than
  ``retain_seconds``, so the file stays bounded however long the job runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_JOURNAL_PATH",
    "JournalError",
    "JournalRecord",
    "JournalSettings",
    "RoundJournal",
]

_log = logging.getLogger(__name__)

DEFAULT_JOURNAL_PATH = Path("lossreduce-journal.sqlite3")
"""Where ``lossreduce serve`` keeps its journal unless told otherwise (working directory)."""

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
"""


class JournalError(RuntimeError):
    """The journal file cannot be opened, read or written; the message names the path."""


class JournalSettings(BaseModel):
    """Where and how the coordinator journals finished rounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path | None = Field(
        default=DEFAULT_JOURNAL_PATH,
        description=(
            "SQLite file holding finished rounds' outcomes (created if missing). "
            "None turns journaling off: a restarted coordinator then forgets finished rounds."
        ),
    )
    synchronous: Literal["normal", "full"] = Field(
        default="normal",
        description=(
            "SQLite synchronous mode (WAL journal). 'normal': no fsync per commit; survives the "
            "process being killed, may lose the last commits on power loss. 'full': fsync every "
            "commit; survives power loss, slower."
        ),
    )
    retain_rounds_per_group: int = Field(
        default=10_000,
        ge=1,
        description="Keep at most this many of the newest steps per (job, group); older ones are deleted.",
    )
    retain_seconds: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="Delete rounds that finished longer ago than this many seconds.",
    )
    max_batch: int = Field(
        default=1024,
        ge=1,
        description="Most rounds committed in one transaction by the writer thread.",
    )
    compact_every: int = Field(
        default=512,
        ge=1,
        description="Run retention (delete old rounds) after this many rounds were written.",
    )


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One finished round: its key, when it finished (wall clock) and its encoded outcome."""

    job: str
    group: str
    step: int
    finished_at: float
    payload: bytes


Callback = Callable[[BaseException | None], None]
# An async writer waits on a future; a thread waits via a callback.
Waiter = asyncio.Future[None] | Callback
_STOP = object()


class RoundJournal:
    """The journal file, its writer thread and its restart-horizon reader.

    Use as a context manager or call :meth:`open` / :meth:`close`.
    :meth:`write` (async) and :meth:`write_sync` return once the record is
    committed; :meth:`lookup` may be called from any one thread at a time.
    """

    def __init__(self, settings: JournalSettings) -> None:
        if settings.path is None:
            raise ValueError("JournalSettings.path is None: journaling is off, open no journal")
        self.settings = settings
        self.path: Path = settings.path
        self._queue: queue.SimpleQueue[tuple[JournalRecord, Waiter] | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        self._horizon: dict[tuple[str, str], int] = {}
        self._closed = False
        self.written = 0
        """Records committed since open (a statistic)."""

    # -- lifecycle -------------------------------------------------------

    def open(self) -> RoundJournal:
        """Create or open the file, compact it, and start the writer thread."""
        writer = self._connect()
        try:
            self._init_schema(writer)
            self._compact(writer, groups=None, now=time.time())
            self._horizon = {
                (job, grp): step + _STEP_OFFSET
                for job, grp, step in writer.execute(
                    "SELECT job, grp, MAX(step) FROM rounds GROUP BY job, grp"
                )
            }
        except sqlite3.Error as exc:
            writer.close()
            raise JournalError(f"cannot open the round journal {str(self.path)!r}: {exc}") from exc
        self._reader = self._connect()
        self._thread = threading.Thread(
            target=self._run_writer, args=(writer,), name="lossreduce-journal", daemon=True
        )
        self._thread.start()
        _log.info(
            "round journal %s open: %d groups with rounds from before this start",
            self.path,
            len(self._horizon),
        )
        return self

    def close(self) -> None:
        """Commit everything queued, stop the writer thread, close the file."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
        if self._reader is not None:
            with self._reader_lock:
                self._reader.close()

    def __enter__(self) -> RoundJournal:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes ----------------------------------------------------------

    def submit(self, record: JournalRecord, waiter: Waiter) -> None:
        """Queue ``record``; after its commit the writer thread settles ``waiter``.

        A future is resolved on its own event loop (one wake-up per loop per
        batch); a callback is called on the writer thread with None or the error.
        """
        if self._closed or self._thread is None:
            raise JournalError(f"the round journal {str(self.path)!r} is not open")
        self._queue.put((record, waiter))

    def write_future(self, record: JournalRecord) -> asyncio.Future[None]:
        """Queue ``record`` and return a future of the running loop done at its commit."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.submit(record, done)
        return done

    async def write(self, record: JournalRecord) -> None:
        """Commit ``record`` without blocking the event loop; returns after the commit."""
        await self.write_future(record)

    def write_sync(self, record: JournalRecord) -> None:
        """Commit ``record`` from a plain thread; returns after the commit."""
        committed = threading.Event()
        failure: list[BaseException] = []

        def resolve(error: BaseException | None) -> None:
            if error is not None:
                failure.append(error)
            committed.set()

        self.submit(record, resolve)
        committed.wait()
        if failure:
            raise failure[0]

    # -- reads -----------------------------------------------------------

    def lookup(self, job: str, group: str, step: int) -> bytes | None:
        """The payload of a round finished before this journal was opened, or None.

        Rounds finished since the open are the coordinator's own to remember,
        so only steps within the restart horizon of their group reach SQLite.
        """
        horizon = self._horizon.get((job, group))
        if horizon is None or step > horizon or self._reader is None:
            return None
        with self._reader_lock:
            row = self._reader.execute(
                "SELECT payload FROM rounds WHERE job = ? AND grp = ? AND step = ?",
                (job, group, step - _STEP_OFFSET),
            ).fetchone()
        return None if row is None else bytes(row[0])

    def records(self, job: str | None = None) -> list[JournalRecord]:
        """Every retained record (of one job), oldest step first; for inspection and tests."""
        sql = "SELECT job, grp, step, finished_at, payload FROM rounds"
        args: tuple[str, ...] = ()
        if job is not None:
            sql += " WHERE job = ?"
            args = (job,)
        sql += " ORDER BY job, grp, step"
        reader = self._reader or self._connect()
        try:
            with self._reader_lock:
                rows = reader.execute(sql, args).fetchall()
        finally:
            if reader is not self._reader:
                reader.close()
        return [
            JournalRecord(job=j, group=g, step=s + _STEP_OFFSET, finished_at=t, payload=bytes(p))
            for j, g, s, t, p in rows
        ]

    # -- internals -------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Autocommit mode: transactions are opened explicitly with BEGIN.
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=10.0
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self.settings.synchronous.upper()}")
            # Truncate the WAL back to 8 MiB after checkpoints so the files stay bounded.
            conn.execute("PRAGMA journal_size_limit=8388608")
        except (OSError, sqlite3.Error) as exc:
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

    def _run_writer(self, conn: sqlite3.Connection) -> None:
        since_compaction = 0
        touched: set[tuple[str, str]] = set()
        try:
            while True:
                batch, stop = self._next_batch()
                if batch:
                    error = self._commit(conn, [record for record, _ in batch])
                    _notify([waiter for _, waiter in batch], error)
                    if error is None:
                        self.written += len(batch)
                        since_compaction += len(batch)
                        touched.update((r.job, r.group) for r, _ in batch)
                if since_compaction >= self.settings.compact_every or (stop and touched):
                    try:
                        self._compact(conn, groups=touched, now=time.time())
                    except sqlite3.Error:
                        _log.exception("round journal %s: retention pass failed", self.path)
                    since_compaction = 0
                    touched = set()
                if stop:
                    return
        finally:
            conn.close()

    def _next_batch(self) -> tuple[list[tuple[JournalRecord, Waiter]], bool]:
        """Block for one item, then take whatever else is already queued."""
        batch: list[tuple[JournalRecord, Waiter]] = []
        item = self._queue.get()
        while True:
            if item is _STOP:
                return batch, True
            assert isinstance(item, tuple)
            batch.append(item)
            if len(batch) >= self.settings.max_batch:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False

    def _commit(
        self, conn: sqlite3.Connection, records: Sequence[JournalRecord]
    ) -> BaseException | None:
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT OR IGNORE INTO rounds (job, grp, step, finished_at, payload) "
                "VALUES (?, ?, ?, ?, ?)",
                [
                    (r.job, r.group, r.step - _STEP_OFFSET, r.finished_at, r.payload)
                    for r in records
                ],
            )
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            _log.error(
                "round journal %s: commit of %d rounds failed: %s", self.path, len(records), exc
            )
            return JournalError(f"cannot write the round journal {str(self.path)!r}: {exc}")
        return None

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


def _notify(waiters: Sequence[Waiter], error: BaseException | None) -> None:
    """Settle a committed batch's waiters: callbacks here, futures on their loops."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for waiter in waiters:
        if isinstance(waiter, asyncio.Future):
            by_loop.setdefault(waiter.get_loop(), []).append(waiter)
        else:
            waiter(error)
    for loop, futures in by_loop.items():
        # A closed loop raises RuntimeError: nobody is waiting there any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, futures, error)


def _settle(futures: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for done in futures:
        if done.done():  # the waiter was cancelled meanwhile
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
