"""Looking after a store: scan (fast, no hashing), verify (re-hash everything), gc and deletion.

Everything returns frozen dataclasses with raw ints and ``*_str`` properties; corrupt parts found
while scanning are collected as warnings, never raised. Deletion is a plan with
``expected_freed_size`` and ``.execute()``, so a dry run costs nothing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotc.cache import blobio, events, failures, unpacked, workdirs
from aotc.cache.deletion import _remove_unreferenced, delete_entries  # noqa: F401 - public here too
from aotc.cache.errors import CorruptedIndexError, StoreReadOnlyError
from aotc.cache.scan import (  # noqa: F401 - re-exported: maintenance is the public face
    DEFAULT_MIN_IDLE,
    DEFAULT_TMP_GRACE,
    EntryInfo,
    StoreScan,
    _blob_files,
    scan,
)

if TYPE_CHECKING:
    from aotc.cache.store import Store

@dataclass(frozen=True)
class Problem:
    """One thing verify found wrong."""

    key: str | None
    name: str | None
    role: str | None
    digest: str | None
    kind: str  # corrupt | missing | garbage-row | marked-bad | orphan | index-corrupt
    detail: str

    def describe(self) -> str:
        where = f"entry {self.key[:12]} ({self.name})" if self.key else "store"
        blob = f" blob {self.role!r} {str(self.digest)[:12]}" if self.role else ""
        return f"{self.kind}: {where}{blob}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "role": self.role, "digest": self.digest,
                "kind": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class VerifyReport:
    """The result of re-hashing every blob. ``ok`` is False when any entry is unusable."""

    entries_checked: int
    blobs_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]
    bad_keys: tuple[str, ...]
    repaired: bool = False
    freed: int = 0
    index_problem: str | None = None  # the index file itself was damaged (see verify_at)

    @property
    def ok(self) -> bool:
        return not self.bad_keys and (self.index_problem is None or self.repaired)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "entries_checked": self.entries_checked,
                "blobs_checked": self.blobs_checked, "bytes_checked": self.bytes_checked,
                "problems": [p.to_json() for p in self.problems], "bad_keys": list(self.bad_keys),
                "repaired": self.repaired, "freed": self.freed, "index_problem": self.index_problem}


def verify(store: Store, repair: bool = False, tmp_grace: float = DEFAULT_TMP_GRACE) -> VerifyReport:
    """Re-hash every referenced blob once; name each bad entry and blob. With ``repair``, evict
    bad entries, orphan blobs and stale staging files (marking entries bad as it goes)."""
    if repair and store.read_only:
        raise StoreReadOnlyError(str(store.root), "repair it")
    problems: list[Problem] = []
    bad: dict[str, str] = {}
    bad_digest: dict[str, str] = {}  # entry -> the blob found bad (marking is conditional on it)
    with store.index.snapshot():  # one consistent state, whatever writers do meanwhile
        blob_rows = {r["digest"]: r for r in store.index.query("SELECT * FROM blobs")}
        entries = {r["key"]: r for r in store.index.query("SELECT * FROM entries")}
        refs = store.index.query("SELECT key, role, digest FROM entry_blobs")
    checked: dict[str, str | None] = {}  # digest -> problem (None = good)
    nbytes = 0
    for ref in refs:
        key, role, digest = ref["key"], ref["role"], ref["digest"]
        name = entries[key]["name"] if key in entries else None
        if key not in entries:
            problems.append(Problem(key, None, role, digest, "garbage-row",
                                    "blob ref belongs to no entry"))
            continue
        if not blobio.is_digest(digest) or digest not in blob_rows:
            problems.append(Problem(key, name, role, str(digest), "garbage-row",
                                    "blob ref points at no valid blob row"))
            bad[key] = f"blob {role!r}: broken index row"
            continue
        if digest not in checked:
            row = blob_rows[digest]
            try:
                nbytes += blobio.hash_blob(store.blob_path(digest), digest, int(row["size"]))
                checked[digest] = None
            except blobio.BlobCorrupt as exc:
                checked[digest] = str(exc)
            except (TypeError, ValueError) as exc:
                checked[digest] = f"index row is garbage ({exc})"
        if checked[digest] is not None:
            kind = "missing" if "missing" in str(checked[digest]) else "corrupt"
            problems.append(Problem(key, name, role, digest, kind, str(checked[digest])))
            bad[key] = f"blob {role!r} {digest[:16]}…: {checked[digest]}"
            bad_digest[key] = digest
    for key, row in entries.items():
        try:
            for col in ("factors", "metadata"):
                if not isinstance(json.loads(row[col]), dict):
                    raise ValueError(f"{col} is not a JSON object")
            float(row["created"]), float(row["last_used"]), int(row["hits"])
        except (TypeError, ValueError) as exc:
            problems.append(Problem(key, row["name"], None, None, "garbage-row", str(exc)))
            bad[key] = f"index row is garbage ({exc})"
        if row["bad"] is not None and key not in bad:
            problems.append(Problem(key, row["name"], None, None, "marked-bad", str(row["bad"])))
            bad[key] = str(row["bad"])
    referenced = {r["digest"] for r in refs}
    for digest in sorted(_blob_files(store)):
        if digest not in referenced:
            problems.append(Problem(None, None, None, digest, "orphan", "blob file used by no entry"))
    flagged = []
    for key, reason in bad.items():
        digest = bad_digest.get(key)
        if key in entries and (entries[key]["bad"] is not None or store.mark_bad(key, reason, digest)):
            flagged.append(key)
    freed = 0
    if repair:  # only entries that are (still) marked bad: a concurrent re-put clears the mark
        still_bad = {r["key"] for r in store.index.query("SELECT key FROM entries WHERE bad IS NOT NULL")}
        freed = delete_entries(store, [k for k in flagged if k in still_bad])
        freed += plan_gc(store, max_size=None, tmp_grace=tmp_grace).execute()
    return VerifyReport(
        entries_checked=len(entries), blobs_checked=len(checked), bytes_checked=nbytes,
        problems=tuple(problems), bad_keys=tuple(sorted(bad)), repaired=repair, freed=freed,
    )


def verify_at(root: str | os.PathLike[str], repair: bool = False,
              tmp_grace: float = DEFAULT_TMP_GRACE) -> VerifyReport:
    """``verify`` for the store at ``root``, including a damaged index file: then the report
    carries ``index_problem`` (and is not ok); with ``repair`` the damaged index is renamed to
    ``index.sqlite.corrupt-<time>`` (kept for forensics), an empty one takes its place and the
    blobs nobody refers to any more are collected."""
    from aotc.cache.store import Store

    try:
        store = Store(root, create=False)
        try:  # damage past page 1 shows only in queries: check the whole file first
            bad = store.index.query("PRAGMA quick_check")
            if [r for r in bad if list(r.values()) != ["ok"]]:
                raise CorruptedIndexError(str(store.index_path), "sqlite quick_check: " + "; ".join(
                    str(v) for r in bad[:3] for v in r.values()))
            return verify(store, repair=repair, tmp_grace=tmp_grace)
        finally:
            store.close()
    except CorruptedIndexError as exc:
        if repair and not os.access(Path(exc.path).parent, os.W_OK):
            raise StoreReadOnlyError(str(root), "repair it") from exc
        if not repair:
            problem = Problem(None, None, None, None, "index-corrupt", exc.problem)
            return VerifyReport(0, 0, 0, (problem,), (), index_problem=exc.problem)
        aside = _set_index_aside(Path(exc.path))
        store = Store(root)
        report = verify(store, repair=True, tmp_grace=tmp_grace)
        store.close()
        problem = Problem(None, None, None, None, "index-corrupt",
                          f"{exc.problem}; set aside as {aside.name}, started an empty index")
        return replace(report, problems=(problem, *report.problems), index_problem=exc.problem)


def _set_index_aside(index: Path) -> Path:
    aside = index.with_name(f"{index.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(index, aside)
    for suffix in ("-wal", "-shm"):  # a WAL of a broken image is not replayed onto a fresh one
        side = index.with_name(index.name + suffix)
        if side.exists():
            os.replace(side, aside.with_name(aside.name + suffix))
    return aside


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
    protected: tuple[EntryInfo, ...] = ()  # over max_size but spared: used within min_idle
    failures: tuple[str, ...] = ()  # keys of remembered failures: forgotten, so tried again
    unpacked_dirs: tuple[str, ...] = ()  # unpacked copies to remove (cache/unpacked.py)

    def execute(self) -> int:
        """Delete what the plan names; returns the bytes actually freed."""
        freed = delete_entries(self.store, [e.key for e in self.entries],
                               idle_before=time.time() - self.min_idle)
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
        return freed + unpacked.remove(self.store, self.unpacked_dirs)

    def to_json(self) -> dict[str, Any]:
        return {"entries": [e.to_json() for e in self.entries],
                "orphan_blobs": list(self.orphan_blobs), "tmp_files": list(self.tmp_files),
                "expected_freed_size": self.expected_freed_size, "size_before": self.size_before,
                "max_size": self.max_size, "min_idle": self.min_idle,
                "protected": [e.to_json() for e in self.protected],
                "failures_forgotten": list(self.failures), "unpacked_dirs": list(self.unpacked_dirs)}


def plan_gc(store: Store, max_size: int | None = None, tmp_grace: float = DEFAULT_TMP_GRACE,
            min_idle: float = DEFAULT_MIN_IDLE) -> GcPlan:
    """Plan a collection: orphan blobs, staging files older than ``tmp_grace`` seconds, and — when
    the store exceeds ``max_size`` bytes on disk — least recently used entries until it fits.
    Entries written or read in the last ``min_idle`` seconds are never evicted (a loader may be
    reading them; ``execute`` re-checks under the write lock), even if the store stays too big."""
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
        users: dict[str, set[str]] = {}
        for r in store.index.query("SELECT key, digest FROM entry_blobs"):
            users.setdefault(r["digest"], set()).add(r["key"])
        remaining = s.size_on_disk - (freed - tmp_size)  # blobs and unpacked copies left
        gone: set[str] = set()
        recent = time.time() - min_idle
        for entry in sorted(s.entries, key=lambda e: (e.last_used, e.created)):
            if remaining <= max_size:
                break
            if entry.key in unpacked_sizes and max(entry.last_used, entry.created) <= recent:
                drop.append(entry.key)
                remaining -= unpacked_sizes[entry.key]
                freed += unpacked_sizes[entry.key]
        for entry in sorted(s.entries, key=lambda e: (e.last_used, e.created)):
            if remaining <= max_size:
                break
            if max(entry.last_used, entry.created) > recent:
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
                  unpacked_dirs=tuple(drop))


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

