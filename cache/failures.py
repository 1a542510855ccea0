"""Graphs aotc gave up on, remembered in the store so the next process does not try again.

A row per key (a graph's store key, or the fingerprint of a graph that could not be keyed): the
name, the version of aotc's compile code that failed (a new aotc tries again: its row is not
read), the reason in one line, when, and how many tries. The backend reads it before it splits,
compiles or checks a graph, and falls back at once naming the reason. ``aotc inspect cache``
lists the rows, ``aotc gc`` forgets them all (``GcPlan``) (the next process tries again), and a successful
put of the key forgets its row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aotc.cache.store import Store

__all__ = ["Failure", "failures", "forget", "lookup", "remember"]

_MAX_REASON = 600


@dataclass(frozen=True)
class Failure:
    """One remembered failure."""

    key: str
    name: str
    version: str
    reason: str
    time: float
    tries: int


def _has_table(store: Store) -> bool:
    return store.index.has_column("failures", "key")  # a read-only store may predate the table


def remember(store: Store, key: str, name: str, version: str, reason: str) -> bool:
    """Record that ``key`` failed under aotc ``version`` (a row already there counts one more
    try and takes the new reason). Returns False on a read-only store (nothing recorded)."""
    if store.read_only or not _has_table(store):
        return False
    reason = " ".join(reason.split())[:_MAX_REASON]
    with store.index.write() as conn:
        conn.execute(
            "INSERT INTO [failures] ([key], [name], [version], [reason], [time]) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT([key]) DO UPDATE SET [name] = excluded.[name], [version] = excluded.[version],"
            " [reason] = excluded.[reason], [time] = excluded.[time], [tries] = [tries] + 1",
            (key, name, version, reason, time.time()))
    return True


def lookup(store: Store, key: str, version: str) -> Failure | None:
    """The failure remembered for ``key`` under this aotc ``version``; None when there is none
    (or it was another version's)."""
    if not _has_table(store):
        return None
    rows = store.index.query("SELECT * FROM [failures] WHERE [key] = ? AND [version] = ?", (key, version))
    return _row(rows[0]) if rows else None


def failures(store: Store) -> list[Failure]:
    """Every remembered failure, newest first."""
    if not _has_table(store):
        return []
    return [_row(r) for r in store.index.query("SELECT * FROM [failures] ORDER BY [time] DESC")]


def forget(store: Store, key: str) -> bool:
    """Forget ``key``'s failure (it was stored after all, or is to be tried again)."""
    if store.read_only or not _has_table(store):
        return False
    return store.index.execute("DELETE FROM [failures] WHERE [key] = ?", (key,)) > 0


def _row(r: dict[str, Any]) -> Failure:
    return Failure(str(r["key"]), str(r["name"]), str(r["version"]), str(r["reason"]),
                   float(r["time"]), int(r["tries"]))
