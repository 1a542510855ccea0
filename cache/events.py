"""The ``events`` table (one row per hit, miss, put, corrupt, delete), kept to a bounded size.

Only the newest ``EVENTS_CAP`` rows are kept. Trimming is cheap and rare: an insert whose row id
is a multiple of ``TRIM_EVERY`` deletes the rows older than the newest ``EVENTS_CAP`` (at most
``TRIM_BATCH`` of them, so a store grown large before the cap shrinks over a few trims instead of
stalling one ``get``), and ``gc`` trims the rest. Every other insert is the one ``INSERT`` it was.

The hit and miss counts of the rows trimmed are folded into the ``meta`` table first (same
transaction), so ``totals`` — ``aotc inspect``'s "N hits / M misses" — stays exact.
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aotc.cache.index import Index

EVENTS_CAP = 10_000  # rows kept: the newest
TRIM_EVERY = 500  # an insert whose row id is a multiple of this trims
TRIM_BATCH = 2_000  # the most rows one trim on the warm path deletes (gc: all that are over)
COUNTED = ("hit", "miss")  # kinds whose totals survive trimming (meta "events_trimmed_<kind>")

_INSERT = "INSERT INTO events (time, key, kind, detail) VALUES (?, ?, ?, ?)"


def _due(rowid: int | None) -> bool:
    return rowid is not None and rowid > 0 and rowid % TRIM_EVERY == 0


def insert(conn: sqlite3.Connection, key: str | None, kind: str, detail: str | None,
           now: float | None = None) -> None:
    """Add an event inside the caller's write transaction (and trim there when due)."""
    cur = conn.execute(_INSERT, (time.time() if now is None else now, key, kind, detail))
    if _due(cur.lastrowid):
        trim(conn, TRIM_BATCH)


def record(index: Index, key: str | None, kind: str, detail: str | None) -> None:
    """Add an event in one autocommitted statement (the warm path); when due, trim in a write
    transaction of its own."""
    if _due(index.insert(_INSERT, (time.time(), key, kind, detail))):
        with index.write() as conn:
            trim(conn, TRIM_BATCH)


def trim(conn: sqlite3.Connection, limit: int | None = None) -> int:
    """Inside a write transaction: delete the rows older than the newest ``EVENTS_CAP`` (at most
    ``limit``), their hit/miss counts folded into ``meta`` first. Returns the rows deleted."""
    low, high = conn.execute("SELECT MIN(id), MAX(id) FROM events").fetchone()
    if high is None:
        return 0
    cutoff = high - EVENTS_CAP
    if limit is not None:
        cutoff = min(cutoff, low + limit - 1)
    if cutoff < low:
        return 0
    counts = conn.execute(
        f"SELECT kind, COUNT(*) FROM events WHERE id <= ? AND kind IN ({','.join('?' * len(COUNTED))})"
        " GROUP BY kind", (cutoff, *COUNTED)).fetchall()
    for kind, n in counts:
        conn.execute("INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE"
                     " SET value = CAST(value AS INTEGER) + excluded.value",
                     (f"events_trimmed_{kind}", n))
    return int(conn.execute("DELETE FROM events WHERE id <= ?", (cutoff,)).rowcount)


def trim_all(index: Index) -> int:
    """Trim every row over the cap (``gc``); returns the rows deleted."""
    with index.write() as conn:
        return trim(conn)


def totals(index: Index) -> dict[str, int]:
    """Hits and misses ever recorded (kind -> count): the rows kept plus those trimmed."""
    marks = ",".join("?" * len(COUNTED))
    with index.snapshot():
        live = index.query(f"SELECT kind, COUNT(*) AS n FROM events WHERE kind IN ({marks})"
                           " GROUP BY kind", COUNTED)
        folded = index.query(f"SELECT name, value FROM meta WHERE name IN ({marks})",
                             tuple(f"events_trimmed_{k}" for k in COUNTED))
    out = dict.fromkeys(COUNTED, 0)
    for r in live:
        out[r["kind"]] += int(r["n"])
    for r in folded:
        try:
            out[r["name"].removeprefix("events_trimmed_")] += int(r["value"])
        except (TypeError, ValueError):
            continue  # a garbage meta row: the live count is still right
    return out
