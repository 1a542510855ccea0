"""Deleting entries, the blobs no entry uses any more (under the index's write lock) and the
entries' unpacked copies (used by ``Store.delete``, ``gc`` and ``verify --repair``)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aotc.cache import blobio, events, unpacked

if TYPE_CHECKING:
    from aotc.cache.store import Store

__all__ = ["delete_entries"]


def _remove_unreferenced(store: Store, digests: Iterable[str]) -> int:
    """Delete blob rows and files that no entry refers to (checked under the write lock, so a
    concurrent put cannot start referring to one in between). Rows go in the same transaction as
    the unlinks; a crash part way leaves unreferenced rows or files, which gc collects later."""
    freed = 0
    with store.index.write() as conn:
        for digest in set(digests):
            if conn.execute("SELECT 1 FROM entry_blobs WHERE digest = ? LIMIT 1", (digest,)).fetchone():
                continue
            conn.execute("DELETE FROM blobs WHERE digest = ?", (digest,))
            if blobio.is_digest(digest):
                path = store.blob_path(digest)
                try:
                    size = path.stat().st_size
                    path.unlink()
                    freed += size
                except FileNotFoundError:
                    pass
                except OSError:  # cannot delete now (permissions, busy): leave it for next time
                    continue
    return freed


def delete_entries(store: Store, keys: Iterable[str], idle_before: float | None = None) -> int:
    """Delete entries, then the blobs only they used; returns bytes freed. Two steps: the rows
    (one transaction, committed), then the files — a crash in between leaves orphans, never an
    entry whose blobs are gone. With ``idle_before`` (a time), an entry written or read after it
    is kept: checked inside the write transaction, so a loader that has marked its entry used
    (``Store.get``) before the deletion commits never loses its blobs mid-read."""
    keys = list(keys)
    if not keys:
        return 0
    now = time.time()
    digests: list[str] = []
    deleted: list[str] = []
    with store.index.write() as conn:
        for key in keys:
            if idle_before is not None:
                row = conn.execute("SELECT MAX(created, last_used) FROM entries WHERE key = ?",
                                   (key,)).fetchone()
                if row is not None and row[0] is not None and row[0] > idle_before:
                    continue  # in use since the plan was made
            deleted.append(key)
            digests += [r[0] for r in conn.execute(
                "SELECT digest FROM entry_blobs WHERE key = ?", (key,))]
            conn.execute("DELETE FROM entry_blobs WHERE key = ?", (key,))
            conn.execute("DELETE FROM signatures WHERE key = ?", (key,))
            conn.execute("DELETE FROM entries WHERE key = ?", (key,))
            events.insert(conn, key, "delete", None, now)
    freed = _remove_unreferenced(store, digests)
    # their unpacked copies (aotc.cache.unpacked) too, but for one a process is loading from: gc's
    return freed + unpacked.remove(store, [k for k in deleted if blobio.is_digest(k)])
