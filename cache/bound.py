"""Eviction: gc's plan (``plan_gc``, least recently used entries first) and a store that bounds
itself (``AOTC_MAX_SIZE``: ``Store(root, max_size=...)`` evicts after each put, as ccache does).

An entry is never evicted while it is protected:

- written or read in the last ``min_idle`` seconds (a loader may be between ``Store.get`` and
  its reads; ``delete_entries`` re-checks this under the index's write lock);
- **held** by a running process (this one included): a process serving an entry holds a shared
  ``locks/hold-<key>`` lock until it exits (``locks.hold``, taken where the entry's files are
  unpacked for a load). Eviction takes that lock exclusively without waiting, deletes the entry
  with it held and skips the entry when it cannot; a process killed releases its holds.

After a put the check is one index query (the blobs' sizes on disk); only a store over its bound
is scanned and planned, and only entries (and their unpacked copies) are evicted — orphan blobs,
staging files and remembered failures are ``aotc gc``'s. The entry just put is never evicted.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from aotc.cache import blobio, events, failures, unpacked, workdirs
from aotc.cache.deletion import _remove_unreferenced, delete_entries
from aotc.cache.errors import AotcError
from aotc.cache.humanize import format_size
from aotc.cache.locks import FileLock, is_held, lock_path
from aotc.cache.scan import DEFAULT_MIN_IDLE, DEFAULT_TMP_GRACE, EntryInfo, _blob_files, scan

if TYPE_CHECKING:
    from aotc.cache.store import Store

__all__ = ["GcPlan", "after_put", "evict_to_bound", "parse_size", "plan_gc", "used_size"]

_log = logging.getLogger("aotc.cache")
_LOCK_KINDS = ("hold", "build")


@dataclass(frozen=True)
class GcPlan:
    """What a gc would delete; ``execute()`` does it (re-checking each blob under the lock)."""

    store: Store = field(repr=False, compare=False)
    entries: tuple[EntryInfo, ...]
    orphan_blobs: tuple[str, ...]
    tmp_files: tuple[str, ...]
    expected_freed_size: int
    size_before: int
    max_size: int | None
    min_idle: float = DEFAULT_MIN_IDLE
    protected: tuple[EntryInfo, ...] = ()  # over max_size but spared: used within min_idle, or held
    failures: tuple[str, ...] = ()  # keys of remembered failures: forgotten, so tried again
    unpacked_dirs: tuple[str, ...] = ()  # unpacked copies to remove (cache/unpacked.py)
    stale_locks: tuple[str, ...] = ()  # lock files (locks/) of entries that are gone

    def execute(self) -> int:
        """Delete what the plan names; returns the bytes actually freed. An entry a process has
        come to hold (or use) since the plan was made is kept."""
        freed = _evict(self.store, [e.key for e in self.entries], time.time() - self.min_idle)
        freed += _remove_unreferenced(self.store, self.orphan_blobs)
        # blob rows whose file vanished and that nobody references
        rows = self.store.index.query("SELECT digest FROM blobs WHERE digest NOT IN"
                                      " (SELECT digest FROM entry_blobs)")
        freed += _remove_unreferenced(self.store, [r["digest"] for r in rows])
        for key in self.failures:
            failures.forget(self.store, key)
        events.trim_all(self.store.index)  # the event rows over the cap (a get trims a batch)
        for name in self.tmp_files:
            path = self.store.tmp_dir / name
            try:
                if path.is_dir():  # a compile's work dir, an unpack's staging, a loader's own: if idle
                    freed += workdirs.remove_idle(path)
                    continue
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
        _remove_locks(self.store, self.stale_locks)
        return freed + unpacked.remove(self.store, self.unpacked_dirs)

    def to_json(self) -> dict[str, Any]:
        return {"entries": [e.to_json() for e in self.entries],
                "orphan_blobs": list(self.orphan_blobs), "tmp_files": list(self.tmp_files),
                "expected_freed_size": self.expected_freed_size, "size_before": self.size_before,
                "max_size": self.max_size, "min_idle": self.min_idle,
                "protected": [e.to_json() for e in self.protected],
                "failures_forgotten": list(self.failures), "unpacked_dirs": list(self.unpacked_dirs),
                "stale_locks": list(self.stale_locks)}


def plan_gc(store: Store, max_size: int | None = None, tmp_grace: float = DEFAULT_TMP_GRACE,
            min_idle: float = DEFAULT_MIN_IDLE, exclude: Collection[str] = ()) -> GcPlan:
    """Plan a collection: orphan blobs, staging files older than ``tmp_grace`` seconds, lock
    files of entries that are gone, and — when the store exceeds ``max_size`` bytes on disk —
    least recently used entries until it fits. Entries written or read in the last ``min_idle``
    seconds, entries a running process holds (``locks.hold``) and the keys in ``exclude`` are
    never evicted (``protected``), even if the store stays too big."""
    s = scan(store, tmp_grace=tmp_grace)
    files = _blob_files(store)
    sizes: dict[str, int] = {}
    for digest, path in files.items():
        try:
            sizes[digest] = path.stat().st_size
        except FileNotFoundError:
            sizes[digest] = 0
    tmp = [store.tmp_dir / n for n in s.stale_tmp_files]
    tmp_size = sum(workdirs.tree_size(p) if p.is_dir() else p.stat().st_size
                   for p in tmp if p.exists())
    # unpacked copies (cache/unpacked.py) of entries that are gone, and under max_size those of
    # idle entries (least recently used first) before any entry is evicted: a load re-makes them
    unpacked_sizes = dict(s.unpacked_dirs)
    live = {e.key for e in s.entries}
    drop = [name for name in unpacked_sizes if name not in live]
    freed = tmp_size + sum(sizes.get(d, 0) for d in s.orphan_blobs) + sum(unpacked_sizes[n] for n in drop)
    victims: list[EntryInfo] = []
    protected: list[EntryInfo] = []
    if max_size is not None:
        held: dict[str, bool] = {}
        recent = time.time() - min_idle

        def spared(entry: EntryInfo) -> bool:
            if entry.key in exclude or max(entry.last_used, entry.created) > recent:
                return True
            if entry.key not in held:
                held[entry.key] = is_held(store.base, entry.key)
            return held[entry.key]

        users: dict[str, set[str]] = {}
        for r in store.index.query("SELECT key, digest FROM entry_blobs"):
            users.setdefault(r["digest"], set()).add(r["key"])
        remaining = s.size_on_disk - (freed - tmp_size)  # blobs and unpacked copies left
        gone: set[str] = set()
        lru = sorted(s.entries, key=lambda e: (e.last_used, e.created))
        for entry in lru:
            if remaining <= max_size:
                break
            if entry.key in unpacked_sizes and not spared(entry):
                drop.append(entry.key)
                remaining -= unpacked_sizes[entry.key]
                freed += unpacked_sizes[entry.key]
        for entry in lru:
            if remaining <= max_size:
                break
            if spared(entry):
                protected.append(entry)
                continue
            gone.add(entry.key)
            victims.append(entry)
            for digest, keys in users.items():
                if entry.key in keys and keys <= gone:
                    remaining -= sizes.get(digest, 0)
                    freed += sizes.get(digest, 0)
                    keys.clear()  # counted once
    return GcPlan(store=store, entries=tuple(victims), orphan_blobs=s.orphan_blobs,
                  tmp_files=s.stale_tmp_files, expected_freed_size=freed,
                  size_before=s.size_on_disk, max_size=max_size, min_idle=min_idle,
                  protected=tuple(protected), failures=tuple(f.key for f in s.failures),
                  unpacked_dirs=tuple(drop), stale_locks=_stale_locks(store, live))


def _evict(store: Store, keys: Iterable[str], idle_before: float) -> int:
    """Delete the entries among ``keys`` that nobody holds, each with its hold lock taken
    exclusively (without waiting) until it is deleted; their lock files go with them."""
    taken: dict[str, FileLock] = {}
    try:
        for key in keys:
            lock = FileLock(lock_path(store.base, "hold", key))
            try:
                if lock.acquire(timeout=0):
                    taken[key] = lock
            except OSError:  # no lock folder to write: nobody could have taken a hold there
                taken[key] = lock
        freed = delete_entries(store, list(taken), idle_before=idle_before)
        still = {r["key"] for r in store.index.query("SELECT key FROM entries")} if taken else set()
        for key, lock in taken.items():
            if key not in still and lock.held:
                lock.path.unlink(missing_ok=True)
        return freed
    finally:
        for lock in taken.values():
            lock.release()


def _stale_locks(store: Store, live: Collection[str]) -> tuple[str, ...]:
    """The lock files under ``locks/`` whose entry is not in the store (``live``)."""
    folder = store.base / "locks"
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return ()
    out = []
    for name in names:
        kind, _, key = name.partition("-")
        if kind in _LOCK_KINDS and blobio.is_digest(key) and key not in live:
            out.append(name)
    return tuple(out)


def _remove_locks(store: Store, names: Iterable[str]) -> None:
    """Remove lock files nobody holds now (taken exclusively first, without waiting)."""
    for name in names:
        lock = FileLock(store.base / "locks" / name)
        try:
            if lock.acquire(timeout=0):
                lock.path.unlink(missing_ok=True)
        except OSError:
            continue
        finally:
            lock.release()


def used_size(store: Store) -> int:
    """The bytes the store's blobs take on disk, from the index (one query: the cheap check a
    put makes; ``scan`` measures everything, unpacked copies included)."""
    rows = store.index.query("SELECT COALESCE(SUM(stored_size), 0) AS n FROM blobs")
    return int(rows[0]["n"] or 0)


def evict_to_bound(store: Store, keep: str, min_idle: float = DEFAULT_MIN_IDLE) -> int:
    """After a put of ``keep``: when the store has a bound (``store.max_size``) and is over it,
    evict the least recently used entries (and idle entries' unpacked copies) until it fits,
    never ``keep``, one used in the last ``min_idle`` seconds or one a process holds. Returns the
    bytes freed (0 at once when under the bound)."""
    limit = store.max_size
    if limit is None or store.read_only or used_size(store) <= limit:
        return 0
    plan = replace(plan_gc(store, max_size=limit, min_idle=min_idle, exclude=(keep,)),
                   orphan_blobs=(), tmp_files=(), failures=(), stale_locks=())
    freed = plan.execute()
    if plan.entries or freed:
        _log.info(f"aotc: store {store.root} over its max size {format_size(limit)}: evicted "
                  f"{len(plan.entries)} least recently used entries, freed {format_size(freed)}")
    if plan.protected and plan.expected_freed_size < plan.size_before - limit:
        _log.info(f"aotc: store {store.root} stays over its max size {format_size(limit)}: "
                  f"{len(plan.protected)} entries are in use (held, or used in the last "
                  f"{min_idle:g}s)")
    return freed


def after_put(store: Store, key: str) -> None:
    """``Store.put``'s last step, once ``key`` is committed: ``evict_to_bound`` when the store has
    a bound. The put has succeeded whatever happens here: a failure is one warning."""
    if store.max_size is None:
        return
    try:
        evict_to_bound(store, keep=key)
    except (AotcError, OSError, sqlite3.Error) as exc:
        _log.warning(f"aotc: could not keep store {store.root} within its max size: {exc}")


def parse_size(text: str) -> int:
    """'10G', '512M', '1.5GiB', '1000' → bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    mult = 1
    if t and t[-1] in units:
        mult, t = units[t[-1]], t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 500M, 10G)") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"not a size: {text!r} (must be >= 0)")
    return int(value * mult)
