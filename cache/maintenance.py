"""Looking after a store: scan (fast, no hashing), verify (re-hash everything), gc and deletion
(gc's plan lives in :mod:`aotc.cache.bound`, re-exported here).

Everything returns frozen dataclasses with raw ints and ``*_str`` properties; corrupt parts found
while scanning are collected as warnings, never raised. Deletion is a plan with
``expected_freed_size`` and ``.execute()``, so a dry run costs nothing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotc.cache import blobio
from aotc.cache.bound import GcPlan, parse_size, plan_gc  # noqa: F401 - public here too
from aotc.cache.deletion import delete_entries  # noqa: F401 - public here too
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
