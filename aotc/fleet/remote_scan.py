"""A remote store made visible: ``scan_remote`` lists its entries (``aotc inspect cache --store
s3://…``) and ``verify_remote`` downloads and re-hashes every blob (``aotc verify``), with
``repair`` removing damaged blobs and every record that needs them, so a re-push restores them.
Needs no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aotc.cache import blobio
from aotc.cache.scan import EntryInfo
from aotc.errors import DamagedRemoteEntry, MissingObject, RemoteError
from aotc.fleet.objects import RemoteObject
from aotc.fleet.remote_api import Remote
from aotc.fleet.sync import remote_entry


@dataclass(frozen=True)
class RemoteScan:
    """The remote's entries and what its listing shows (nothing is hashed)."""

    url: str
    entries: tuple[EntryInfo, ...]
    blob_count: int
    blob_bytes: int
    orphan_blobs: int
    warnings: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"root": self.url, "entries": [e.to_json() for e in self.entries],
                "blobs": self.blob_count, "size_on_disk": self.blob_bytes,
                "orphan_blobs": self.orphan_blobs, "warnings": list(self.warnings)}


def _records(remote: Remote) -> tuple[list[tuple[str, float, Any]], list[str]]:
    """(key, modified, Entry or the reason it is damaged) for every record, and warnings."""
    out, warnings = [], []
    for obj in remote.list("entries/"):
        key = obj.name[len("entries/"):].removesuffix(".json")
        if not obj.name.endswith(".json") or not blobio.is_digest(key):
            warnings.append(f"unexpected object {obj.name}")
            continue
        try:
            entry = remote_entry(remote, key)
        except DamagedRemoteEntry as e:
            out.append((key, obj.modified, f"record is damaged ({e})"))
            warnings.append(f"entry {key[:16]}…: record is damaged")
            continue
        if entry is not None:  # else deleted since the listing
            out.append((key, obj.modified, entry))
    return out, warnings


def scan_remote(remote: Remote) -> RemoteScan:
    """List the remote's entries (newest first) with sizes from their records."""
    records, warnings = _records(remote)
    blobs = {o.name[len("blobs/"):]: o.size for o in remote.list("blobs/")}
    used: set[str] = set()
    infos = []
    for key, modified, entry in records:
        if isinstance(entry, str):
            infos.append(EntryInfo(key, "?", 0, 0, 0, modified, modified, 0, entry))
            continue
        digests = {b.digest: b for b in entry.blobs.values()}
        used.update(digests)
        missing = [d for d in digests if d not in blobs]
        bad = f"{len(missing)} blob(s) missing on the remote" if missing else None
        if bad:
            warnings.append(f"entry {key[:16]}…: {bad}")
        meta = entry.metadata
        infos.append(EntryInfo(
            key, entry.name, len(digests), sum(b.size for b in digests.values()),
            sum(blobs.get(d, 0) for d in digests), modified, modified, 0, bad,
            pieces=meta.get("pieces") if isinstance(meta.get("pieces"), int) else None,
            shapes=tuple(str(s) for s in meta.get("shapes", [])) if isinstance(meta.get("shapes"), list) else ()))
    infos.sort(key=lambda e: e.created, reverse=True)
    return RemoteScan(remote.url, tuple(infos), len(blobs), sum(blobs.values()),
                      len(set(blobs) - used), tuple(warnings))


@dataclass
class RemoteVerify:
    """What ``verify_remote`` checked and found."""

    url: str
    entries_checked: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    bad_keys: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"root": self.url, "ok": self.ok, "entries_checked": self.entries_checked,
                "blobs_checked": self.blobs_checked, "bytes_checked": self.bytes_checked,
                "problems": self.problems, "bad_keys": self.bad_keys, "removed": self.removed}


def verify_remote(remote: Remote, repair: bool = False) -> RemoteVerify:
    """Download and re-hash every blob an entry of ``remote`` names; with ``repair``, delete the
    damaged blobs and the records (with their markers and signatures) that name a damaged or
    missing blob or are damaged themselves."""
    report = RemoteVerify(remote.url)
    records, _warnings = _records(remote)
    verdict: dict[str, str | None] = {}  # digest -> problem (None: good)
    for key, _modified, entry in records:
        report.entries_checked += 1
        if isinstance(entry, str):
            report.problems.append(f"entry {key[:16]}…: {entry}")
            report.bad_keys.append(key)
            continue
        bad = False
        for role, ref in sorted(entry.blobs.items()):
            if ref.digest not in verdict:
                verdict[ref.digest] = _check_blob(remote, ref.digest, ref.size, ref.stored_size,
                                                  report)
            if verdict[ref.digest] is not None:
                report.problems.append(f"entry {key[:16]}… {entry.name}: blob {role!r} "
                                       f"{ref.digest[:16]}… {verdict[ref.digest]}")
                bad = True
        if bad:
            report.bad_keys.append(key)
    if repair:  # records (with markers and signatures) first: no reader meets a record whose
        for key in report.bad_keys:  # blob is being deleted
            for obj in [*_markers(remote, key), *remote.list(f"signatures/{key}/")]:
                remote.delete(obj.name)
            remote.delete(remote.entry_name(key))
            report.removed.append(remote.entry_name(key))
        for digest, problem in verdict.items():
            if problem is not None and problem != "is missing":
                remote.delete(remote.blob_name(digest))
                report.removed.append(remote.blob_name(digest))
    return report


def _markers(remote: Remote, key: str) -> list[RemoteObject]:
    return [o for o in remote.list("probes/") if o.name.endswith("/" + key)]


def _check_blob(remote: Remote, digest: str, size: int, stored_size: int,
                report: RemoteVerify) -> str | None:
    """None when the remote blob is ``stored_size`` bytes at most and decompresses to ``size``
    bytes hashing to ``digest``."""
    try:
        body, length = remote.open(remote.blob_name(digest))
    except MissingObject:
        return "is missing"
    report.blobs_checked += 1
    if length > stored_size:  # padding a pull would refuse
        body.close()
        return f"is damaged ({length} bytes on the server, its record says {stored_size})"
    report.bytes_checked += length
    try:
        blobio.hash_blob(body, digest, size)
    except blobio.BlobCorrupt as e:
        return f"is damaged ({e})"
    except (OSError, *remote.errors) as e:  # type: ignore[misc]  # boto's classes, known at run time
        raise RemoteError(f"{remote.url}: download of blob {digest[:16]}… broke off ({e})") from None
    return None
