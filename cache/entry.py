"""What an entry is: its record, its blob refs, and the bytes a signature of it covers.

``aotc.cache.store`` re-exports ``Entry`` and ``BlobRef``; the parsing of an index row lives here
so that ``Store.get`` and ``Store.put`` (which reads the entry it keeps) parse alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aotc.cache import blobio

SignFunction = Callable[[bytes], tuple[str, str]]
"""Signs an entry as it is stored: given ``signing_payload(entry)``, returns ``(public key hex,
signature hex)`` (``Store.put(..., sign=...)``; the cryptography is in ``aotc.fleet.trust``)."""


@dataclass(frozen=True)
class BlobRef:
    """One named blob of an entry."""

    role: str
    digest: str
    size: int
    stored_size: int


@dataclass(frozen=True)
class Entry:
    """An entry as read from the index (its bytes are read on demand, verified)."""

    key: str
    name: str
    factors: dict[str, Any] = field(hash=False)
    metadata: dict[str, Any] = field(hash=False)
    blobs: Mapping[str, BlobRef] = field(hash=False)
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0

    @property
    def size(self) -> int:
        """Uncompressed bytes of all its blobs."""
        return sum(b.size for b in self.blobs.values())

    @property
    def stored_size(self) -> int:
        """Compressed bytes of all its blobs on disk (shared blobs counted in full)."""
        return sum(b.stored_size for b in self.blobs.values())

    @property
    def blob_map(self) -> dict[str, str]:
        """Its content: role -> digest."""
        return {r: b.digest for r, b in self.blobs.items()}


def signing_payload(entry: Entry) -> bytes:
    """The bytes a signature covers: the entry's record (key, name, factors, metadata) and
    every blob's role and digest, as canonical JSON."""
    record = {"format": 1, "key": entry.key, "name": entry.name, "factors": entry.factors,
              "metadata": entry.metadata,
              "blobs": {r: b.digest for r, b in sorted(entry.blobs.items())}}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def entry_from_rows(key: str, row: Mapping[str, Any], refs: list[dict[str, Any]]) -> Entry:
    """An ``Entry`` from its ``entries`` row and its ``entry_blobs``⋈``blobs`` rows (role, digest,
    size, stored_size). ``ValueError``/``TypeError`` when a row is garbage."""
    blobs: dict[str, BlobRef] = {}
    for ref in refs:
        if ref["size"] is None or not blobio.is_digest(ref["digest"]):
            raise ValueError(f"blob {ref['role']!r} has no valid blob row")
        blobs[str(ref["role"])] = BlobRef(str(ref["role"]), ref["digest"], int(ref["size"]),
                                          int(ref["stored_size"]))
    factors = json.loads(row["factors"])
    metadata = json.loads(row["metadata"])
    if not isinstance(factors, dict) or not isinstance(metadata, dict):
        raise ValueError("factors/metadata is not a JSON object")
    return Entry(key=key, name=str(row["name"]), factors=factors, metadata=metadata, blobs=blobs,
                 created=float(row["created"]), last_used=float(row["last_used"]),
                 hits=int(row["hits"]))


ENTRY_REFS_SQL = ("SELECT eb.role, eb.digest, b.size, b.stored_size FROM entry_blobs eb"
                  " LEFT JOIN blobs b ON b.digest = eb.digest WHERE eb.key = ?")
"""The blob refs of one entry, as ``entry_from_rows`` takes them."""
