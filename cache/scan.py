"""Describing a store from its index and a directory listing, without hashing anything:
entries with sizes and use, orphan blobs, stale staging files, hit/miss counts, and warnings
for whatever looks corrupt (collected, never raised)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotc.cache import events, failures, unpacked, workdirs
from aotc.cache.failures import Failure
from aotc.cache.humanize import format_age, format_size

if TYPE_CHECKING:
    from aotc.cache.store import Store

DEFAULT_TMP_GRACE = 3600.0  # a staging file younger than this may belong to a live writer
DEFAULT_MIN_IDLE = 300.0  # gc never evicts an entry written or read more recently than this


@dataclass(frozen=True)
class EntryInfo:
    """One entry as the index describes it."""

    key: str
    name: str
    blob_count: int
    size: int
    stored_size: int
    created: float
    last_used: float
    hits: int
    bad: str | None
    pieces: int | None = None
    shapes: tuple[str, ...] = ()
    shared_blobs: int = 0  # of its distinct blobs, how many another entry holds too
    shared_stored_size: int = 0  # their bytes on disk (counted in stored_size as well)

    @property
    def key_short(self) -> str:
        return self.key[:12]

    @property
    def size_str(self) -> str:
        return format_size(self.size)

    @property
    def stored_size_str(self) -> str:
        return format_size(self.stored_size)

    @property
    def created_str(self) -> str:
        return format_age(self.created)

    @property
    def last_used_str(self) -> str:
        return format_age(self.last_used)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON for ``--json`` output."""
        return {
            "key": self.key, "name": self.name, "blobs": self.blob_count, "size": self.size,
            "stored_size": self.stored_size, "created": self.created, "last_used": self.last_used,
            "hits": self.hits, "bad": self.bad, "pieces": self.pieces, "shapes": list(self.shapes),
            "shared_blobs": self.shared_blobs, "shared_stored_size": self.shared_stored_size,
        }


@dataclass(frozen=True)
class StoreScan:
    """What ``scan`` found: entries, totals and warnings (nothing is hashed)."""

    root: str
    entries: tuple[EntryInfo, ...]
    size_on_disk: int
    orphan_blobs: tuple[str, ...]
    stale_tmp_files: tuple[str, ...]
    hits: int
    misses: int
    warnings: tuple[str, ...]
    # graphs aotc gave up on, with their reason class and next retry (cache/failures.py)
    failures: tuple[Failure, ...] = ()
    # (name, bytes) of each directory under unpacked/ (cache/unpacked.py; counted in size_on_disk)
    unpacked_dirs: tuple[tuple[str, int], ...] = ()

    @property
    def size_on_disk_str(self) -> str:
        return format_size(self.size_on_disk)

    @property
    def unpacked_size(self) -> int:
        """Bytes of the entries' unpacked copies (part of ``size_on_disk``)."""
        return sum(size for _name, size in self.unpacked_dirs)

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root, "entries": [e.to_json() for e in self.entries],
            "size_on_disk": self.size_on_disk, "orphan_blobs": list(self.orphan_blobs),
            "stale_tmp_files": list(self.stale_tmp_files), "hits": self.hits,
            "misses": self.misses, "warnings": list(self.warnings),
            "failures": [f.to_json() for f in self.failures],
            "unpacked_size": self.unpacked_size, "unpacked_dirs": dict(self.unpacked_dirs),
        }


def _blob_files(store: Store) -> dict[str, Path]:
    found: dict[str, Path] = {}
    if not store.blobs_dir.is_dir():
        return found
    for sub in store.blobs_dir.iterdir():
        if sub.is_dir():
            for f in sub.iterdir():
                found[f.name] = f
    return found


def _tmp_files(store: Store, grace: float) -> list[Path]:
    if not store.tmp_dir.is_dir():
        return []
    cutoff = time.time() - grace
    out = []
    for f in store.tmp_dir.iterdir():
        try:
            # a compile's checkpoints, an unpack being staged, a loader's own directory
            # (cache/unpacked.py): garbage once nobody holds it and it was idle that long
            if f.is_dir():
                if workdirs.stale(f, cutoff):
                    out.append(f)
            elif f.stat().st_mtime <= cutoff:
                out.append(f)
        except FileNotFoundError:
            continue
    return out


def _entry_info(row: dict[str, Any], by_key: dict[str, list[dict[str, Any]]],
                blob_rows: dict[str, dict[str, Any]], files: dict[str, Path],
                warnings: list[str], holders: dict[str, int]) -> EntryInfo:
    """One entry's figures over its DISTINCT blobs (several roles may name one blob: batched
    kernel libraries, identical artifacts), so no entry is ever larger than the store."""
    key = str(row["key"])

    size = stored = shared = shared_stored = 0
    seen: set[str] = set()
    for ref in by_key.get(key, []):
        if ref["digest"] in seen:
            continue
        seen.add(ref["digest"])
        blob = blob_rows.get(ref["digest"])
        if blob is None:
            warnings.append(f"entry {key[:12]} ({row['name']}): blob {ref['role']!r} has no index row")
            continue
        if ref["digest"] not in files:
            warnings.append(
                f"entry {key[:12]} ({row['name']}): blob {ref['role']!r} "
                f"{str(ref['digest'])[:12]} is missing on disk"
            )
        size += int(blob["size"] or 0)
        stored += int(blob["stored_size"] or 0)
        if holders.get(ref["digest"], 0) > 1:
            shared += 1
            shared_stored += int(blob["stored_size"] or 0)
    pieces: int | None = None
    shapes: tuple[str, ...] = ()
    try:
        meta = json.loads(row["metadata"])
        pieces = meta.get("pieces") if isinstance(meta.get("pieces"), int) else None
        if isinstance(meta.get("shapes"), list):
            shapes = tuple(str(s) for s in meta["shapes"])
    except (TypeError, ValueError, AttributeError):
        warnings.append(f"entry {key[:12]} ({row['name']}): metadata is not valid JSON")
    if row["bad"] is not None:
        warnings.append(f"entry {key[:12]} ({row['name']}) is marked bad: {row['bad']}")
    return EntryInfo(
        key=key, name=str(row["name"]), blob_count=len(seen), size=size,
        stored_size=stored, created=float(row["created"] or 0),
        last_used=float(row["last_used"] or 0), hits=int(row["hits"] or 0), bad=row["bad"],
        pieces=pieces, shapes=shapes, shared_blobs=shared, shared_stored_size=shared_stored,
    )


def scan(store: Store, tmp_grace: float = DEFAULT_TMP_GRACE) -> StoreScan:
    """Describe the store from its index and a directory listing (no blob is decompressed)."""
    warnings: list[str] = []
    files = _blob_files(store)
    with store.index.snapshot():
        blob_rows = {r["digest"]: r for r in store.index.query("SELECT * FROM blobs")}
        refs = store.index.query("SELECT key, role, digest FROM entry_blobs")
        entry_rows = store.index.query("SELECT * FROM entries ORDER BY last_used DESC")
    by_key: dict[str, list[dict[str, Any]]] = {}
    keys_of: dict[str, set[str]] = {}
    for ref in refs:
        by_key.setdefault(ref["key"], []).append(ref)
        keys_of.setdefault(ref["digest"], set()).add(ref["key"])
    holders = {digest: len(keys) for digest, keys in keys_of.items()}
    entries = []
    for row in entry_rows:
        try:
            entries.append(_entry_info(row, by_key, blob_rows, files, warnings, holders))
        except (TypeError, ValueError) as exc:
            warnings.append(f"entry {str(row['key'])[:12]}: index row is garbage ({exc})")
    referenced = {r["digest"] for r in refs}
    orphans = sorted(d for d in files if d not in referenced)
    size_on_disk = 0
    for f in files.values():
        try:
            size_on_disk += f.stat().st_size
        except FileNotFoundError:
            continue
    unpacked_dirs = tuple(sorted(unpacked.sizes(store).items()))
    size_on_disk += sum(size for _name, size in unpacked_dirs)
    counts = events.totals(store.index)  # exact, though old event rows are trimmed
    return StoreScan(
        root=str(store.root), entries=tuple(entries), size_on_disk=size_on_disk,
        orphan_blobs=tuple(orphans),
        stale_tmp_files=tuple(sorted(f.name for f in _tmp_files(store, tmp_grace))),
        hits=int(counts.get("hit", 0)), misses=int(counts.get("miss", 0)), warnings=tuple(warnings),
        failures=tuple(failures.failures(store)), unpacked_dirs=unpacked_dirs,
    )
