"""The content-addressed store: ``put`` an entry atomically, ``get`` it back with verified bytes.

Layout (see DESIGN.md "The store")::

    <root>/CACHEDIR.TAG  <root>/.gitignore
    <root>/store-v1/index.sqlite
    <root>/store-v1/blobs/ab/abcdef…      zstd, named by the sha256 of the uncompressed bytes
    <root>/store-v1/tmp/                  staging; garbage after a crash

Write protocol: every blob is staged in ``tmp/``, fsynced and renamed into ``blobs/``; then one
sqlite transaction checks that each blob file is still there and adds the entry with its blob
refs (and, with a signer, its signature). A crash leaves at most orphan blobs or staging files,
never an entry pointing at a missing or partial blob (nor, with a signer, one unsigned). Read
protocol: every blob is decompressed and re-hashed; a mismatch marks the entry bad and raises
``CorruptedCacheError``.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from aotc.cache import blobio, bound, events
from aotc.cache.entry import ENTRY_REFS_SQL, BlobRef, Entry, SignFunction, entry_from_rows, signing_payload
from aotc.cache.errors import CacheMiss, CorruptedCacheError, StoreError, StoreNotFoundError, StoreReadOnlyError
from aotc.cache.index import Index

__all__ = ["LAYOUT", "BlobRef", "Entry", "SignFunction", "Store"]

LAYOUT = "store-v1"
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by aotc.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


def _validate_key(key: object) -> str:
    if not blobio.is_digest(key):
        raise StoreError(f"store key must be 64 lowercase hex characters (a sha256), got {key!r}")
    return key  # type: ignore[return-value]  # validated above: the key is a str of 64 hex digits


_ANNOUNCED_READ_ONLY: set[str] = set()


class Store:
    """A store rooted at ``root``. Safe across threads and processes.

    ``create``: make the store when ``root`` holds none (commands that write: compile, import,
    pull); otherwise a missing store is a ``StoreNotFoundError`` naming the path. A store whose
    directory this process cannot write (a read-only volume or image layer) opens read-only:
    entries are read and verified as usual, hits and last use are not recorded (said once on
    stderr), and anything that would write raises ``StoreReadOnlyError``. ``max_size`` (bytes,
    ``AOTC_MAX_SIZE``): after each put, least recently used entries are evicted while the store
    is over it (:mod:`aotc.cache.bound`)."""

    def __init__(self, root: str | os.PathLike[str], busy_timeout: float = 30.0,
                 create: bool = True, max_size: int | None = None) -> None:
        self.root = Path(root).expanduser()
        self.max_size = max_size  # bytes (AOTC_MAX_SIZE): a put evicts LRU entries over it (bound.py)
        self.base = self.root / LAYOUT
        self.blobs_dir = self.base / "blobs"
        self.tmp_dir = self.base / "tmp"
        self.index_path = self.base / "index.sqlite"
        exists = self.index_path.is_file()
        if not exists and not create:
            raise StoreNotFoundError(str(self.root))
        self.read_only = exists and not (os.access(self.base, os.W_OK)
                                         and os.access(self.index_path, os.W_OK))
        if self.read_only:
            if str(self.root) not in _ANNOUNCED_READ_ONLY:
                _ANNOUNCED_READ_ONLY.add(str(self.root))
                logging.getLogger("aotc.cache").warning(
                    f"aotc: store {self.root} is read-only: serving from it; hits and last-use "
                    "times are not recorded")
        else:
            try:
                self.blobs_dir.mkdir(parents=True, exist_ok=True)
                self.tmp_dir.mkdir(parents=True, exist_ok=True)
                tag = self.root / "CACHEDIR.TAG"
                if not tag.exists():
                    tag.write_text(CACHEDIR_TAG)
                ignore = self.root / ".gitignore"
                if not ignore.exists():
                    ignore.write_text("*\n")
            except OSError as exc:
                raise StoreError(f"cannot create the store at {self.root}: {exc}; pass --store DIR or "
                                 "set AOTC_STORE") from exc
        self.index = Index(self.index_path, busy_timeout=busy_timeout, read_only=self.read_only)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def close(self) -> None:
        """Close this thread's index connection."""
        self.index.close()

    def blob_path(self, digest: str) -> Path:
        """Where a blob lives (the digest is validated first: index rows may be garbage)."""
        if not blobio.is_digest(digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.blobs_dir / digest[:2] / digest

    # -- write ------------------------------------------------------------------------------
    def put(
        self,
        key: str,
        name: str,
        blobs: Mapping[str, blobio.BlobSource],
        factors: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        sign: SignFunction | None = None,
        signatures: Mapping[str, str] | None = None,
    ) -> Entry:
        """Store an entry atomically: blobs (role → bytes or file path) first, the index rows
        last, in one transaction. Returns the entry as stored.

        A key that exists (two compiles of one key, a pull of a key held) leaves one entry:
        - same content (the held entry is not marked bad and maps the same roles to the same
          digests): the held entry is kept as it is (name, factors, metadata: the signatures it
          has still verify over the same payload), with its signatures; its last use is renewed.
        - other content (or the held entry is bad): it is replaced, and its signatures dropped,
          in the same transaction.

        ``sign``: given ``signing_payload`` of the entry about to be visible (the held one when
        it is kept), returns ``(public key hex, signature hex)``; that signature is written in
        the same transaction as the entry (replacing this signer's older one), so the entry is
        never visible unsigned (it may be called under the write lock: keep it quick). A ``sign``
        that raises leaves nothing visible (blobs already published are orphans for gc).
        ``signatures``: signatures made elsewhere over this entry's payload (public key hex →
        signature hex: what a pull or a bundle import verified), written in the same
        transaction — when the held record is kept, only if its payload is the same."""
        _validate_key(key)
        if self.read_only:
            raise StoreReadOnlyError(str(self.root), f"store entry {key[:16]}…")
        factors_json = json.dumps(dict(factors or {}), sort_keys=True)
        metadata_json = json.dumps(dict(metadata or {}), sort_keys=True)
        probe = (metadata or {}).get("probe")
        probe = probe if isinstance(probe, str) else None
        for role in blobs:
            if not isinstance(role, str) or not role:
                raise StoreError(f"blob roles must be non-empty strings, got {role!r}")
        signed: dict[bytes, tuple[str, str]] = {}

        def signature(entry: Entry) -> tuple[str, str] | None:
            if sign is None:
                return None
            payload = signing_payload(entry)
            if payload not in signed:
                got = sign(payload)
                if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(x, str) for x in got)):
                    raise StoreError(f"sign must return (public key hex, signature hex), got {got!r}")
                signed[payload] = got
            return signed[payload]

        staged = {role: self._publish(source) for role, source in blobs.items()}
        for _attempt in range(3):
            # the entry as a reader will parse it: its payload is what a signature covers
            new = Entry(key, name, json.loads(factors_json), json.loads(metadata_json),
                        {r: BlobRef(r, s.digest, s.size, s.stored_size) for r, s in staged.items()})
            signature(new)  # before the write lock when the entry is new or replaced
            with self.index.write() as conn:
                missing = [r for r, s in staged.items() if not self.blob_path(s.digest).exists()]
                if not missing:
                    stored = self._write_entry(conn, new, factors_json, metadata_json, probe,
                                               signature, dict(signatures or {}))
            if not missing:  # committed: now keep the store within its bound (never this entry)
                bound.after_put(self, key)
                return stored
            # a concurrent gc removed a blob we dedup'ed against: publish it again and retry
            for role in missing:
                staged[role] = self._publish(blobs[role])
        raise StoreError(f"could not put entry {key[:16]}…: its blobs kept being collected")

    def _write_entry(self, conn: sqlite3.Connection, new: Entry, factors_json: str,
                     metadata_json: str, probe: str | None,
                     signature: Callable[[Entry], tuple[str, str] | None],
                     premade: dict[str, str]) -> Entry:
        """``put``'s rows, inside its write transaction (see ``put`` for the rules)."""
        key, now = new.key, time.time()
        row, refs = self._rows(key)
        try:  # a held row marked bad, or garbage, is replaced
            held = entry_from_rows(key, row, refs) if row is not None and row["bad"] is None else None
        except (TypeError, ValueError):
            held = None
        if held is not None and held.blob_map == new.blob_map:
            conn.execute("UPDATE entries SET last_used = ? WHERE key = ?", (now, key))
            stored = replace(held, last_used=now)
        else:
            conn.execute("DELETE FROM entry_blobs WHERE key = ?", (key,))
            for role, ref in new.blobs.items():
                conn.execute("INSERT OR IGNORE INTO blobs (digest, size, stored_size, created)"
                             " VALUES (?, ?, ?, ?)", (ref.digest, ref.size, ref.stored_size, now))
                conn.execute("INSERT INTO entry_blobs (key, role, digest) VALUES (?, ?, ?)",
                             (key, role, ref.digest))
            conn.execute("DELETE FROM signatures WHERE key = ?", (key,))  # they signed other content
            conn.execute(
                "INSERT OR REPLACE INTO entries (key, name, factors, metadata, created,"
                " last_used, hits, bad, probe) VALUES (?, ?, ?, ?, ?, ?, 0, NULL, ?)",
                (key, new.name, factors_json, metadata_json, now, now, probe),
            )
            row, refs = self._rows(key)  # as stored (a blob row may predate this put)
            assert row is not None  # just written, in this transaction
            stored = entry_from_rows(key, row, refs)
        sig = signature(stored)
        sigs = dict(premade) if premade and signing_payload(stored) == signing_payload(new) else {}
        if sig is not None:
            sigs[sig[0]] = sig[1]
        for public, value in sigs.items():
            conn.execute("INSERT OR REPLACE INTO signatures (key, public_key, signature, time)"
                         " VALUES (?, ?, ?, ?)", (key, public, value, now))
        events.insert(conn, key, "put", new.name, now)
        return stored

    def _publish(self, source: blobio.BlobSource) -> blobio.StagedBlob:
        s = blobio.stage_blob(source, self.tmp_dir)
        dest = self.blob_path(s.digest)
        dest.parent.mkdir(exist_ok=True)
        # Always replace, even when a file of that name exists: the fresh copy is known good,
        # the old one may be damaged; readers holding the old file keep reading it unharmed.
        os.replace(s.path, dest)
        blobio.fsync_dir(dest.parent)
        return blobio.StagedBlob(s.digest, s.size, s.stored_size, dest)

    # -- read -------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        """True when a (not known-bad) entry exists for ``key``; no accounting, no verification."""
        rows = self.index.query("SELECT bad FROM entries WHERE key = ?", (key,))
        return bool(rows) and rows[0]["bad"] is None

    def get(self, key: str, record: bool = True) -> Entry:
        """The entry for ``key``; raises ``CacheMiss`` or ``CorruptedCacheError``. With ``record``
        a hit (or miss) is counted and the entry's last use is updated. Blob bytes are read with
        ``read_blob`` / ``extract_blob``, which verify them."""
        with self.index.snapshot():  # the row and its refs from one state of the index
            row, refs = self._rows(key)
        if row is None:
            if record and not self.read_only:
                self._event(key, "miss", None)
            raise CacheMiss(key)
        if row["bad"] is not None:
            raise CorruptedCacheError(key, "entry", "-" * 16, f"marked bad earlier: {row['bad']}")
        try:
            entry = entry_from_rows(key, row, refs)
        except (TypeError, ValueError) as exc:
            self.mark_bad(key, f"index row is garbage ({exc})")
            raise CorruptedCacheError(key, "entry", "-" * 16, f"index row is garbage ({exc})") from exc
        if record and not self.read_only:  # marks the entry in use: gc spares it (min_idle)
            now = time.time()
            with self.index.write() as conn:  # the mark and its event: one commit, not two
                if not conn.execute("UPDATE entries SET hits = hits + 1, last_used = ? WHERE key = ?",
                                    (now, key)).rowcount:  # evicted since the read above
                    raise CacheMiss(key)
                events.insert(conn, key, "hit", None, now)
        return entry

    def _rows(self, key: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The ``entries`` row of ``key`` (None) and its blob refs, in the caller's transaction."""
        rows = self.index.query("SELECT * FROM entries WHERE key = ?", (key,))
        return (rows[0], self.index.query(ENTRY_REFS_SQL, (key,))) if rows else (None, [])

    def read_blob(self, entry: Entry, role: str) -> bytes:
        """The verified uncompressed bytes of one blob of ``entry``."""
        ref = self._ref(entry, role)
        try:
            return blobio.read_blob_bytes(self.blob_path(ref.digest), ref.digest, ref.size)
        except blobio.BlobCorrupt as exc:
            self._corrupt(entry.key, ref, str(exc))

    def verify_blob(self, entry: Entry, role: str) -> None:
        """Re-hash one blob of ``entry`` without keeping its bytes (``CorruptedCacheError`` and
        the entry marked bad when it is damaged, as on every read)."""
        ref = self._ref(entry, role)
        try:
            blobio.hash_blob(self.blob_path(ref.digest), ref.digest, ref.size)
        except blobio.BlobCorrupt as exc:
            self._corrupt(entry.key, ref, str(exc))

    def extract_blob(self, entry: Entry, role: str, dest: str | os.PathLike[str]) -> Path:
        """Stream one blob, verified, to ``dest`` (written beside it first, renamed when good)."""
        ref = self._ref(entry, role)
        try:
            return blobio.extract_to(self.blob_path(ref.digest), ref.digest, ref.size, Path(dest))
        except blobio.BlobCorrupt as exc:
            self._corrupt(entry.key, ref, str(exc))

    def extract_blobs(
        self, entry: Entry, dests: Mapping[str, str | os.PathLike[str]], workers: int | None = None
    ) -> dict[str, Path]:
        """Extract several blobs (role → destination) in parallel threads: zstd and sha256 release
        the GIL, so a many-blob entry loads at the speed of all cores, not one."""
        from concurrent.futures import ThreadPoolExecutor

        workers = workers or min(len(dests), os.cpu_count() or 1) or 1
        if workers == 1:
            return {role: self.extract_blob(entry, role, d) for role, d in dests.items()}
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {role: pool.submit(self.extract_blob, entry, role, d) for role, d in dests.items()}
            return {role: f.result() for role, f in futures.items()}

    def _ref(self, entry: Entry, role: str) -> BlobRef:
        try:
            return entry.blobs[role]
        except KeyError:
            raise StoreError(
                f"entry {entry.key[:16]}… has no blob {role!r} (it has {sorted(entry.blobs)})"
            ) from None

    def _corrupt(self, key: str, ref: BlobRef, problem: str) -> NoReturn:
        """A blob read failed: mark the entry bad only if it still uses that blob (it may have
        been replaced or evicted while we read it — then this is a miss, not corruption)."""
        if self.mark_bad(key, f"blob {ref.role!r} {ref.digest[:16]}…: {problem}", digest=ref.digest):
            raise CorruptedCacheError(key, ref.role, ref.digest, problem)
        raise CacheMiss(key, hint="the entry was replaced or evicted while being read; look it up again")

    def mark_bad(self, key: str, reason: str, digest: str | None = None) -> bool:
        """Flag an entry so it is never used again until repaired or re-put. With ``digest``,
        only while the entry still refers to that blob. Returns whether it was flagged
        (a read-only store cannot keep the flag: the damage is reported all the same)."""
        if self.read_only:
            return True
        with self.index.write() as conn:
            if digest is not None and not conn.execute(
                    "SELECT 1 FROM entry_blobs WHERE key = ? AND digest = ? LIMIT 1",
                    (key, digest)).fetchone():
                return False
            cur = conn.execute("UPDATE entries SET bad = ? WHERE key = ?", (reason, key))
            if cur.rowcount:
                events.insert(conn, key, "corrupt", reason)
            return bool(cur.rowcount)

    def record_miss(self, key: str, detail: str | None = None) -> None:
        """Count a miss decided outside ``get`` (e.g. a compile that found nothing)."""
        self._event(key, "miss", detail)

    def _event(self, key: str | None, kind: str, detail: str | None) -> None:
        if not self.read_only:
            events.record(self.index, key, kind, detail)

    def delete(self, key: str) -> int:
        """Delete an entry and every blob no other entry uses; returns the bytes freed on disk."""
        from aotc.cache.deletion import delete_entries

        return delete_entries(self, [key])

    # -- signatures (the cryptography is in aotc.fleet.trust; the store keeps the rows)
    @staticmethod
    def signing_payload(entry: Entry) -> bytes:
        """The bytes a signature covers (``aotc.cache.entry.signing_payload``)."""
        return signing_payload(entry)

    def add_signature(self, key: str, public_key: str, signature: str) -> None:
        """Record ``public_key``'s signature (hex) of entry ``key`` (replacing an older one)."""
        with self.index.write() as conn:
            if not conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone():
                raise CacheMiss(key)
            conn.execute("INSERT OR REPLACE INTO signatures (key, public_key, signature, time)"
                         " VALUES (?, ?, ?, ?)", (key, public_key, signature, time.time()))

    def signatures(self, key: str) -> dict[str, str]:
        """The signatures recorded for ``key``: public key (hex) -> signature (hex)."""
        return {r["public_key"]: r["signature"] for r in self.index.query(
            "SELECT public_key, signature FROM signatures WHERE key = ?", (key,))}

    def entry_rows(self, probe: str | None = None) -> list[dict[str, Any]]:
        """Entries' index rows as stored (``key``, ``name``, ``metadata`` and ``factors`` as
        JSON text, ``bad``), newest first, damaged ones included: a lookup parses each itself,
        so that one garbage row cannot break every lookup. ``probe``: only the rows recorded
        with that lookup probe (an index read, whatever the store holds; a read-only store made
        before the probe column is scanned whole)."""
        if probe is not None and self.index.has_column("entries", "probe"):
            return self.index.query("SELECT key, name, metadata, factors, bad FROM entries "
                                    "WHERE probe = ? ORDER BY created DESC", (probe,))
        return self.index.query("SELECT key, name, metadata, factors, bad FROM entries "
                                "ORDER BY created DESC")

    def newest_key_named(self, name: str) -> str | None:
        """The key of the newest entry of that name, or None."""
        rows = self.index.query("SELECT key FROM entries WHERE name = ? ORDER BY created DESC "
                                "LIMIT 1", (name,))
        return str(rows[0]["key"]) if rows else None

    def keys_with_role(self, role: str) -> list[str]:
        """The keys of the sound entries (not marked bad) holding a blob of that role, newest
        first."""
        return [r["key"] for r in self.index.query(
            "SELECT e.key FROM entries e JOIN entry_blobs b ON b.key = e.key "
            "WHERE b.role = ? AND e.bad IS NULL ORDER BY e.created DESC", (role,))]

    def keys(self) -> list[str]:
        """All entry keys, oldest first."""
        return [r["key"] for r in self.index.query("SELECT key FROM entries ORDER BY created")]
