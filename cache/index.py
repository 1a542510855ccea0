"""The sqlite index of the store: plain ``sqlite3``, WAL mode, a busy timeout, one connection per thread.

Tables:
- ``signatures``: key, public_key (hex), signature (hex) — see ``aotc.fleet.trust``
- ``entries``: key (pk), name, factors (JSON), metadata (JSON), created, last_used, hits, bad
- ``blobs``: digest (pk), size (uncompressed), stored_size (compressed, on disk), created
- ``entry_blobs``: (key, role) pk → digest
- ``events``: id, time, key, kind ("hit" | "miss" | "put" | "corrupt" | "delete"), detail —
  the newest rows only (``aotc.cache.events``)
- ``meta``: name (pk), value (``schema_version``, the hit/miss counts of trimmed events)
- ``failures``: graphs aotc gave up on (``aotc.cache.failures``): key (pk), name, version, reason,
  time, tries, reason_class ("repeats" | "unknown"), attempts — the last two added to a table
  made before them (its rows read as "unknown", one attempt)

Any sqlite client reads it (``sqlite3 index.sqlite .tables``). Write transactions are explicit
``BEGIN IMMEDIATE`` … ``COMMIT`` on the same connection (a hit's mark and its event are one such
short transaction: one commit); a miss's event is one autocommitted ``insert``.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aotc.cache.errors import CorruptedIndexError, StoreError, StoreLockedError, StoreReadOnlyError

SCHEMA_VERSION = 1


def _on_read_only_volume(path: Path) -> bool:
    """Whether ``path`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class Index:
    """One connection per thread to ``index.sqlite`` in WAL mode with a busy timeout."""

    def __init__(self, path: Path, busy_timeout: float = 30.0, read_only: bool = False) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self.read_only = read_only
        self._uri: str | None = None  # read-only: how this index opens (mode=ro or immutable)
        self._local = threading.local()
        self._columns: dict[str, set[str]] = {}  # has_column's memo, by table
        try:
            with self._translate():
                if read_only:
                    self._open_read_only()
                else:
                    self._create_schema()
        except BaseException:
            self.close()  # a failed open must not keep a connection (and its locks) alive
            raise

    def _open_read_only(self) -> None:
        """``mode=ro`` (with sqlite's usual locking: another process may write the store) reads a
        WAL index whose side files exist or can be made. Only on a read-only *volume*, where they
        cannot, is it opened ``immutable`` (no locks, no WAL: nothing can change under us) — and
        not when an unapplied WAL would then be ignored."""
        from urllib.parse import quote

        self._uri = "file:" + quote(str(self.path.resolve())) + "?mode=ro"
        try:
            self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return
        except sqlite3.OperationalError as exc:
            self.close()
            if "unable to open" not in str(exc) or not _on_read_only_volume(self.path):
                raise
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise StoreError(f"store index {self.path} is on a read-only volume with an unapplied "
                             f"write-ahead log ({wal.name}) and no shared-memory file: checkpoint "
                             "it before making the volume read-only (`sqlite3 index.sqlite "
                             "'PRAGMA wal_checkpoint(TRUNCATE)'`)")
        self._uri += "&immutable=1"
        self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()

    # -- connection -------------------------------------------------------------------------
    @property
    def conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(
                    self._uri or str(self.path), timeout=self.busy_timeout, isolation_level=None,
                    uri=self._uri is not None,
                )
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open store index {self.path}: {exc}") from exc
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            self._local.conn = conn
        return conn

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            if _is_locked(exc):
                raise StoreLockedError(str(self.path), self.busy_timeout) from exc
            raise StoreError(f"store index {self.path}: {exc}; run `aotc verify`") from exc
        except sqlite3.DatabaseError as exc:  # malformed image, not a database: the file is damaged
            raise CorruptedIndexError(str(self.path), str(exc)) from exc

    def _create_schema(self) -> None:
        conn = self.conn
        if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
            for attempt in range(50):
                try:
                    conn.execute("PRAGMA journal_mode=wal")
                    break
                except sqlite3.OperationalError as exc:
                    if not _is_locked(exc) or attempt == 49:
                        raise
                    time.sleep(0.05)
        with self.write() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS [entries] ([key] TEXT PRIMARY KEY, [name] TEXT NOT NULL,"
                " [factors] TEXT NOT NULL, [metadata] TEXT NOT NULL, [created] FLOAT NOT NULL,"
                " [last_used] FLOAT NOT NULL, [hits] INTEGER NOT NULL DEFAULT 0, [bad] TEXT)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS [blobs] ([digest] TEXT PRIMARY KEY,"
                " [size] INTEGER NOT NULL, [stored_size] INTEGER NOT NULL, [created] FLOAT NOT NULL)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS [entry_blobs] ([key] TEXT NOT NULL, [role] TEXT NOT NULL,"
                " [digest] TEXT NOT NULL, PRIMARY KEY ([key], [role]))"
            )
            conn.execute(
                "CREATE INDEX IF NOT EXISTS [idx_entry_blobs_digest] ON [entry_blobs] ([digest])"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS [events] ([id] INTEGER PRIMARY KEY, [time] FLOAT NOT NULL,"
                " [key] TEXT, [kind] TEXT NOT NULL, [detail] TEXT)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS [meta] ([name] TEXT PRIMARY KEY, [value] TEXT)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS [signatures] ([key] TEXT NOT NULL, [public_key] TEXT"
                " NOT NULL, [signature] TEXT NOT NULL, [time] FLOAT NOT NULL,"
                " PRIMARY KEY ([key], [public_key]))"
            )
            conn.execute(  # graphs aotc gave up on (cache/failures.py)
                "CREATE TABLE IF NOT EXISTS [failures] ([key] TEXT PRIMARY KEY, [name] TEXT NOT NULL,"
                " [version] TEXT NOT NULL, [reason] TEXT NOT NULL, [time] FLOAT NOT NULL,"
                " [tries] INTEGER NOT NULL DEFAULT 1, [reason_class] TEXT NOT NULL DEFAULT 'unknown',"
                " [attempts] INTEGER NOT NULL DEFAULT 1)"
            )
            conn.execute(
                "INSERT OR IGNORE INTO [meta] ([name], [value]) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
            self._add_lookup_columns(conn)
            self._add_failure_columns(conn)

    @staticmethod
    def _add_lookup_columns(conn: sqlite3.Connection) -> None:
        """``entries.probe`` (the metadata's lookup probe, filled by ``Store.put``) and indexes
        on it and on the name, so a lookup reads the rows it asks for, not every entry. A store
        made before the column gets it here, filled from each row's metadata (a row whose
        metadata is not JSON gets none: the lookup never finds it, as it never did)."""
        columns = {row[1] for row in conn.execute("PRAGMA table_info([entries])")}
        if "probe" not in columns:
            conn.execute("ALTER TABLE [entries] ADD COLUMN [probe] TEXT")
            conn.execute("UPDATE [entries] SET [probe] = json_extract([metadata], '$.probe') "
                         "WHERE json_valid([metadata]) AND json_type([metadata], '$.probe') = 'text'")
        conn.execute("CREATE INDEX IF NOT EXISTS [idx_entries_probe] ON [entries] ([probe])")
        conn.execute("CREATE INDEX IF NOT EXISTS [idx_entries_name] ON [entries] ([name], [created])")

    @staticmethod
    def _add_failure_columns(conn: sqlite3.Connection) -> None:
        """``failures.reason_class`` and ``failures.attempts`` (``aotc.cache.failures``): a store
        made before them gets them here, each old row an ``unknown`` failure of one attempt (tried
        again an hour after it was recorded, not remembered for good)."""
        columns = {row[1] for row in conn.execute("PRAGMA table_info([failures])")}
        if "reason_class" not in columns:
            conn.execute("ALTER TABLE [failures] ADD COLUMN [reason_class] TEXT NOT NULL DEFAULT 'unknown'")
        if "attempts" not in columns:
            conn.execute("ALTER TABLE [failures] ADD COLUMN [attempts] INTEGER NOT NULL DEFAULT 1")

    def has_column(self, table: str, column: str) -> bool:
        """Whether ``table`` has ``column`` (a read-only store may predate it). Asked once per
        table and index object: a column another process adds later is seen by a new one."""
        if table not in self._columns:
            with self._translate():
                self._columns[table] = {row[1] for row in self.conn.execute(f"PRAGMA table_info([{table}])")}
        return column in self._columns[table]

    # -- transactions -----------------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """An immediate (write-locked) transaction: commit on success, roll back on error."""
        if self.read_only:
            raise StoreReadOnlyError(str(self.path.parent.parent), "change its index")
        conn = self.conn
        with self._translate():
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # sqlite may have rolled back by itself (I/O error)
                    conn.execute("ROLLBACK")
                raise

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """A read transaction: every query inside sees one consistent state of the index."""
        conn = self.conn
        with self._translate():
            if conn.in_transaction:  # nested: the outer transaction is the snapshot
                yield
                return
            conn.execute("BEGIN")
            try:
                yield
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        """Rows of a read query as dicts."""
        with self._translate():
            cur = self.conn.execute(sql, params)
            names = [d[0] for d in cur.description or ()]
            return [dict(zip(names, row)) for row in cur]

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """One autocommitted statement; returns the number of rows it changed."""
        if self.read_only:
            raise StoreReadOnlyError(str(self.path.parent.parent), "record use")
        with self._translate():
            return int(self.conn.execute(sql, params).rowcount)

    def insert(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """One autocommitted ``INSERT`` (accounting: events); returns the new row's id."""
        if self.read_only:
            raise StoreReadOnlyError(str(self.path.parent.parent), "record use")
        with self._translate():
            return int(self.conn.execute(sql, params).lastrowid or 0)
