"""Graphs aotc gave up on, remembered in the store so the next process does not try again at once.

A row per key (a graph's store key, or the fingerprint of a graph that could not be keyed): the
name, the version of aotc's compile code that failed (a new aotc tries again: its row is not
read), the reason in one line, when it last failed, how many times it failed in all (``tries``),
and its reason class:

- ``repeats``: the failure is known to repeat (an op aotc cannot key, a graph it cannot split,
  a numeric mismatch, an unsupported construct): remembered until the version changes (another
  aotc, another tolerance; another toolchain keys the graph anew).
- ``unknown``: anything else (another library's error, a compiler killed by a signal): retried
  with backoff, never remembered for good. ``attempts`` counts its failures under this version
  and class; it is tried again :func:`backoff` seconds after the last one — 1 hour, then 4, 16,
  64, at most 7 days. Time alone decides (not the number of starts: a server restarting in a
  loop would otherwise retry a broken graph on every start).

The backend reads the row before it splits, compiles or checks a graph and falls back at once
naming the reason, unless an unknown failure's retry is due (:meth:`Failure.due`). ``aotc
inspect cache`` lists the rows with their class and next retry, ``aotc gc`` forgets them all
(``GcPlan``) (the next process tries again), and a successful put of the key forgets its row.
A ``failures`` table from before the class (no ``reason_class``/``attempts`` columns: the index
adds them, ``aotc.cache.index``) reads as ``unknown`` with one attempt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aotc.cache.humanize import format_duration

if TYPE_CHECKING:
    from aotc.cache.store import Store

__all__ = ["CLASSES", "REPEATS", "UNKNOWN", "Failure", "backoff", "failures", "forget", "lookup",
           "remember"]

REPEATS = "repeats"  # known to repeat: remembered until the version changes
UNKNOWN = "unknown"  # retried with backoff
CLASSES = (REPEATS, UNKNOWN)

FIRST_BACKOFF = 3600.0  # an unknown failure is tried again an hour after its first failure,
BACKOFF_FACTOR = 4  # four times longer after each further failure,
MAX_BACKOFF = 7 * 86400.0  # and at least once a week

_MAX_REASON = 600


def backoff(attempts: int) -> float:
    """Seconds after its last failure that an unknown failure of ``attempts`` failures is tried
    again: ``FIRST_BACKOFF * BACKOFF_FACTOR ** (attempts - 1)``, at most ``MAX_BACKOFF``."""
    exponent = min(max(attempts, 1) - 1, 32)  # 4**32 hours is past the cap already
    return min(FIRST_BACKOFF * BACKOFF_FACTOR ** exponent, MAX_BACKOFF)


@dataclass(frozen=True)
class Failure:
    """One remembered failure (module doc): ``time`` is its last failure, ``tries`` every
    failure recorded for the key, ``attempts`` those under this version and class."""

    key: str
    name: str
    version: str
    reason: str
    time: float
    tries: int
    reason_class: str = UNKNOWN
    attempts: int = 1

    @property
    def next_retry(self) -> float | None:
        """When the graph is tried again (seconds since the epoch); None: not before the version
        changes (a failure known to repeat)."""
        return None if self.reason_class == REPEATS else self.time + backoff(self.attempts)

    def due(self, now: float | None = None) -> bool:
        """Whether its retry is due at ``now`` (default: the clock): the graph is compiled again."""
        at = self.next_retry
        return at is not None and (time.time() if now is None else now) >= at

    def next_retry_str(self, now: float | None = None) -> str:
        """'never' (known to repeat), 'due', or 'in 3h'."""
        at = self.next_retry
        if at is None:
            return "never"
        left = at - (time.time() if now is None else now)
        return "due" if left <= 0 else f"in {format_duration(left)}"

    def to_json(self) -> dict[str, Any]:
        """Plain JSON for ``--json`` output: ``next_retry`` is null for a failure known to repeat."""
        return {"key": self.key, "name": self.name, "version": self.version, "reason": self.reason,
                "time": self.time, "tries": self.tries, "class": self.reason_class,
                "attempts": self.attempts, "next_retry": self.next_retry}


def _has_table(store: Store) -> bool:
    return store.index.has_column("failures", "key")  # a read-only store may predate the table


def remember(store: Store, key: str, name: str, version: str, reason: str,
             reason_class: str = UNKNOWN, now: float | None = None) -> bool:
    """Record that ``key`` failed under aotc ``version`` with a failure of ``reason_class``, at
    ``now`` (default: the clock). A row already there counts one more try and takes the new
    reason; its attempts grow by one when version and class are the same, else start again at
    one. Returns False on a read-only store (nothing recorded)."""
    if reason_class not in CLASSES:
        raise ValueError(f"reason class {reason_class!r}: expected one of {', '.join(CLASSES)}")
    if store.read_only or not _has_table(store):
        return False
    reason = " ".join(reason.split())[:_MAX_REASON]
    with store.index.write() as conn:
        conn.execute(  # (every SET expression reads the row as it was)
            "INSERT INTO [failures] ([key], [name], [version], [reason], [time], [reason_class],"
            " [attempts]) VALUES (?, ?, ?, ?, ?, ?, 1)"
            " ON CONFLICT([key]) DO UPDATE SET [name] = excluded.[name], [version] = excluded.[version],"
            " [reason] = excluded.[reason], [time] = excluded.[time], [tries] = [tries] + 1,"
            " [reason_class] = excluded.[reason_class],"
            " [attempts] = CASE WHEN [version] = excluded.[version]"
            " AND [reason_class] = excluded.[reason_class] THEN [attempts] + 1 ELSE 1 END",
            (key, name, version, reason, time.time() if now is None else now, reason_class))
    return True


def lookup(store: Store, key: str, version: str) -> Failure | None:
    """The failure remembered for ``key`` under this aotc ``version``; None when there is none
    (or it was another version's). Whether it is due for a retry is the caller's to ask
    (:meth:`Failure.due`)."""
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
    """A row, of this schema or of one before the class (a read-only store is not migrated)."""
    reason_class = str(r.get("reason_class") or UNKNOWN)
    return Failure(str(r["key"]), str(r["name"]), str(r["version"]), str(r["reason"]),
                   float(r["time"]), int(r["tries"]),
                   reason_class if reason_class in CLASSES else UNKNOWN, int(r.get("attempts") or 1))
