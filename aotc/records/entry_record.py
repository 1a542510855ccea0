"""One store entry as a portable record, and verified staging of its blobs: what a bundle file
(``aotc.fleet.bundle``) and a remote store (``aotc.fleet.sync``) both carry.

The record is JSON: ``{"format": 1, "key", "name", "factors", "metadata",
"blobs": {role: {"digest", "size", "stored_size"}}}`` (a bundle adds ``"signatures"``). A record
read from elsewhere is never trusted: ``parse_record`` checks every field and that the key is
the hash of the factors; ``stage_verified`` decompresses a blob from any stream into the store's
staging directory, bounded by the recorded size and re-hashed, before ``Store.put`` sees it.
Needs no torch.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from aotc.cache import Entry, Store, blobio
from aotc.cache.store import BlobRef
from aotc.records.key import compute_key

FORMAT = 1


def build_record(entry: Entry, stored_sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The portable record of ``entry``; ``stored_sizes`` (digest -> compressed bytes as shipped)
    overrides the sizes the index recorded."""
    stored = dict(stored_sizes or {})
    return {"format": FORMAT, "key": entry.key, "name": entry.name, "factors": entry.factors,
            "metadata": entry.metadata,
            "blobs": {r: {"digest": b.digest, "size": b.size,
                          "stored_size": stored.get(b.digest, b.stored_size)}
                      for r, b in sorted(entry.blobs.items())}}


def parse_record(raw: bytes) -> tuple[Entry, dict[str, str]]:
    """An ``Entry`` (and the record's signatures) from untrusted record bytes; ``ValueError``
    naming what is wrong, including a key that is not the hash of the factors."""
    try:
        rec = json.loads(raw)
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            raise ValueError(f"format {rec.get('format') if isinstance(rec, dict) else '?'} "
                             f"(this aotc reads {FORMAT})")
        if not blobio.is_digest(rec["key"]) or not isinstance(rec["name"], str):
            raise ValueError("key/name")
        if not isinstance(rec["factors"], dict) or not isinstance(rec["metadata"], dict):
            raise ValueError("factors/metadata are not objects")
        blobs = {}
        for role, b in rec["blobs"].items():
            if not (isinstance(role, str) and role and blobio.is_digest(b["digest"])
                    and isinstance(b["size"], int) and b["size"] >= 0
                    and isinstance(b["stored_size"], int) and b["stored_size"] >= 0):
                raise ValueError(f"blob {role!r}")
            blobs[role] = BlobRef(role, b["digest"], b["size"], b["stored_size"])
        sigs = rec.get("signatures", {})
        if not isinstance(sigs, dict):
            raise ValueError("signatures")
        if compute_key(rec["factors"]) != rec["key"]:
            raise ValueError("its key is not the hash of its factors")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ValueError(str(e) or type(e).__name__) from None
    entry = Entry(key=rec["key"], name=rec["name"], factors=rec["factors"],
                  metadata=rec["metadata"], blobs=blobs)
    return entry, {str(k): str(v) for k, v in sigs.items()}


def stage_verified(store: Store, stream: BinaryIO, digest: str, size: int) -> Path:
    """Decompress one zstd blob from ``stream`` into a new staging file of ``store``, verified
    as the store verifies its own blobs (bounded by ``size``, hashed to ``digest``). Raises
    ``blobio.BlobCorrupt`` (bad bytes) or ``OSError``; nothing is left behind on failure."""
    try:
        fd, name = tempfile.mkstemp(prefix=f"stage-{digest[:16]}-", dir=store.tmp_dir)
    except BaseException:
        stream.close()
        raise
    out = Path(name)
    try:
        with os.fdopen(fd, "wb") as dst:
            blobio.stream_blob(stream, digest, size, dst.write)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def same_content(store: Store, entry: Entry) -> bool:
    """Whether ``store`` already holds ``entry``'s key with the same blobs (not known-bad)."""
    if not store.has(entry.key):
        return False
    held = store.get(entry.key, record=False)
    return {r: b.digest for r, b in held.blobs.items()} == {r: b.digest for r, b in entry.blobs.items()}


def put_staged(store: Store, entry: Entry, staged: Mapping[str, Path],
               signatures: Mapping[str, str] | None = None) -> bool:
    """``Store.put`` ``entry`` from staged files (digest -> path) with its verified
    ``signatures`` in the same transaction (never visible unsigned); False (and nothing kept)
    when a staged file changed before it was stored."""
    put = store.put(entry.key, entry.name, {r: staged[b.digest] for r, b in entry.blobs.items()},
                    factors=entry.factors, metadata=entry.metadata, signatures=signatures)
    if {r: b.digest for r, b in put.blobs.items()} != {r: b.digest for r, b in entry.blobs.items()}:
        store.delete(entry.key)
        return False
    return True
