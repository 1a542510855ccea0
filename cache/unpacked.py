"""Entries' files unpacked once, inside the store, and reused by every later load — so a warm start
leaves nothing outside the store (a process ended by SIGKILL, ``os._exit`` or a container stop used
to leave its extracted kernel libraries in TMPDIR for good).

Layout (under ``<root>/store-v1/``)::

    unpacked/<key>/<rel>        blobs of entry <key> a load asked for, at the loader's relative paths
    unpacked/<key>/.lock        held (shared flock) by each process while it loads from the directory
    tmp/unpack-<key16>-…/       a first unpack (or a repair) being written; renamed into place
    tmp/load-<pid>-…/           one process's writable directory (hard links to unpacked files, plus
                                whatever Inductor writes while loading), held for the process's life

Write: the first process extracts the blobs it needs (each verified, as on every read) into a
staging directory in ``tmp/`` and renames it to ``unpacked/<key>``; of two processes racing, one
rename wins and the other uses the winner's directory. A file the directory lacks (an earlier load
asked for other roles) is extracted to ``tmp/`` and renamed in on its own.
Reuse: nothing is decompressed again, but each file is re-hashed against its blob's digest (the
sha256 of the uncompressed bytes) before it is used; a missing, truncated or changed one is
extracted again from its verified blob and replaced atomically (changed ones named in one warning).
Holds: ``unpack`` takes the entry's hold (``locks.hold``: a shared lock kept until this process
exits), so that eviction (``AOTC_MAX_SIZE``, ``gc --max-size``) never takes an entry a process
serves from.
Collection: ``delete_entries`` (``Store.delete``, gc's evictions, ``verify --repair``) removes the
directories of the entries it deletes, and ``gc`` those of entries that no longer exist, or of idle
ones under ``--max-size`` pressure — never one a process is loading from (it holds the lock).
A read-only store gets no unpacked directory: ``unpack`` answers None and the loader extracts into a
per-process directory of its own, as before.

A verified file is used by its path afterwards: whoever can write the store between the check and
the ``dlopen`` can swap it (as they could the index and blobs themselves; signatures guard entries).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from aotc.cache import blobio, locks, workdirs
from aotc.cache.errors import StoreError

if TYPE_CHECKING:
    from aotc.cache.store import BlobRef, Entry, Store

__all__ = ["Unpacked", "entry_dir", "private_dir", "remove", "sizes", "unpack"]

DIR = "unpacked"
STAGING_PREFIX = "unpack-"
PRIVATE_PREFIX = "load-"
LOCK = workdirs.LOCK_NAME
_ATTEMPTS = 5
_log = logging.getLogger("aotc.cache")


def entry_dir(store: Store, key: str) -> Path:
    """Where entry ``key``'s files are unpacked."""
    if not blobio.is_digest(key):
        raise ValueError(f"not an entry key: {key!r}")
    return store.base / DIR / key


class Unpacked:
    """An entry's files, verified, under ``path``; the directory is held (gc spares it) until
    ``close()`` — use it as a context manager around the load. ``reused``: files found good as they
    were; ``extracted``: files written by this call."""

    def __init__(self, path: Path, fd: int, reused: int, extracted: int) -> None:
        self.path, self._fd, self.reused, self.extracted = path, fd, reused, extracted

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Unpacked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Unpacked({str(self.path)!r}, reused={self.reused}, extracted={self.extracted})"


def _safe_rel(rel: str) -> str:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or any(part in ("", ".", "..") for part in p.parts) \
            or p.parts[0] == LOCK or "\\" in rel or "\0" in rel:
        raise StoreError(f"refusing to unpack a blob to {rel!r}: not a plain relative path")
    return p.as_posix()


def unpack(store: Store, entry: Entry, files: Mapping[str, str]) -> Unpacked | None:
    """Entry ``entry``'s blobs (role → relative path) as files under ``unpacked/<key>/``, each one
    checked against its blob's digest; extracted only where missing or not matching. None when the
    store cannot hold them (read-only, or a file-system error: logged) — extract elsewhere then.
    Raises what the store's reads raise (``CorruptedCacheError``, ``CacheMiss``)."""
    if store.read_only:
        return None
    locks.hold(store.base, entry.key)  # until this process exits: eviction skips the entry
    rels = {role: _safe_rel(rel) for role, rel in files.items()}
    missing = sorted(set(rels) - set(entry.blobs))
    if missing:
        raise StoreError(f"entry {entry.key[:16]}… has no blob {missing[0]!r} (it has {sorted(entry.blobs)})")
    refs = {role: entry.blobs[role] for role in rels}
    dest = entry_dir(store, entry.key)
    try:
        for _attempt in range(_ATTEMPTS):
            fd, extracted = (_first_unpack(store, entry, rels, dest) if not dest.is_dir()
                             else (-1, False))
            if fd < 0:
                fd = _hold(dest)
                if fd < 0:
                    continue  # removed under us (gc, a delete): again
            try:
                if extracted:  # just written from verified blobs: nothing to check
                    return Unpacked(dest, fd, 0, len(rels))
                bad = _mismatches(dest, rels, refs)
                if bad:
                    _replace(store, entry, {r: rels[r] for r in bad}, dest)
                    changed = [rels[r] for r, why in bad.items() if why != "missing"]
                    if changed:
                        _log.warning(f"aotc: {len(changed)} unpacked file(s) of entry {entry.key[:16]}… "
                                     f"did not match their blobs (changed, truncated or replaced), "
                                     f"extracted again: {dest / changed[0]}"
                                     + (f" and {len(changed) - 1} more" if len(changed) > 1 else ""))
                return Unpacked(dest, fd, len(rels) - len(bad), len(bad))
            except BaseException:
                os.close(fd)
                raise
        raise OSError(errno.EAGAIN, f"the directory kept being removed after {_ATTEMPTS} tries")
    except OSError as exc:
        _log.warning(f"aotc: cannot unpack entry {entry.key[:16]}… into {dest} ({exc}); "
                     "extracting into a directory of this process instead")
        return None


def _staging(store: Store, key: str) -> tuple[Path, int]:
    """A new staging directory in ``tmp/`` and a shared lock on its ``.lock`` (gc spares it)."""
    stage = store.tmp_dir / f"{STAGING_PREFIX}{key[:16]}-{os.getpid()}-{os.urandom(4).hex()}"
    stage.mkdir(parents=True)
    fd = os.open(stage / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return stage, fd


def _first_unpack(store: Store, entry: Entry, rels: Mapping[str, str], dest: Path) -> tuple[int, bool]:
    """Extract into a staging directory and rename it to ``dest``. Returns the held lock of
    ``dest`` and True when this process's rename won, (-1, False) when another's did."""
    stage, fd = _staging(store, entry.key)
    try:
        store.extract_blobs(entry, {role: stage / rel for role, rel in rels.items()})
        dest.parent.mkdir(exist_ok=True)
        try:
            os.rename(stage, dest)  # the lock file goes with it: this fd now holds dest's lock
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            os.close(fd)
            return -1, False  # another process unpacked it first: use theirs (checked)
        blobio.fsync_dir(dest.parent)
        return fd, True
    except BaseException:
        os.close(fd)
        raise
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def _hold(dest: Path) -> int:
    """A shared lock on ``dest/.lock``, or -1 when ``dest`` is gone or was replaced meanwhile."""
    lock = dest / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError):
        return -1
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a removal holds it exclusively
    try:
        same = os.stat(lock).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return -1
    return fd


def _check(path: Path, ref: BlobRef) -> str | None:
    """None when ``path`` holds exactly the blob's bytes, else what is wrong."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != ref.size:
                return "size"
            h = hashlib.sha256()  # hashlib.file_digest is 3.11+
            while chunk := f.read(blobio.CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc})"
    return None if h.hexdigest() == ref.digest else "digest"


def _mismatches(dest: Path, rels: Mapping[str, str], refs: Mapping[str, BlobRef]) -> dict[str, str]:
    """Role → what is wrong, for each file under ``dest`` that is not its blob (hashed in
    threads: sha256 releases the GIL)."""
    roles = list(rels)
    workers = min(len(roles), os.cpu_count() or 1)
    if workers <= 1:
        found = [_check(dest / rels[r], refs[r]) for r in roles]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=workers) as pool:
            found = list(pool.map(lambda r: _check(dest / rels[r], refs[r]), roles))
    return {r: why for r, why in zip(roles, found) if why is not None}


def _replace(store: Store, entry: Entry, rels: Mapping[str, str], dest: Path) -> None:
    """Extract ``rels`` into a staging directory, then rename each file into ``dest`` (atomic per
    file: a reader sees the old file or the new one, never a partial one)."""
    stage, fd = _staging(store, entry.key)
    try:
        store.extract_blobs(entry, {role: stage / rel for role, rel in rels.items()})
        for rel in rels.values():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / rel, dest / rel)
    finally:
        os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)


# -- a process's own writable directory ---------------------------------------------------------
_PRIVATE: list[tuple[Path, int]] = []


def _remove_private() -> None:
    for path, fd in _PRIVATE:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
    _PRIVATE.clear()


def private_dir(store: Store, src: Path, rels: Iterable[str]) -> Path:
    """A writable directory of this process in the store's ``tmp/`` holding ``src/rel`` for each
    ``rel`` (hard links; copies where a link cannot be made), for a loader that writes beside the
    files it reads (Inductor's cache dir). Removed at exit; held (a lock) while this process lives,
    so ``gc`` collects it only once the process is gone, however it ended."""
    path = store.tmp_dir / f"{PRIVATE_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(parents=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    if not _PRIVATE:
        atexit.register(_remove_private)
    _PRIVATE.append((path, fd))
    for rel in map(_safe_rel, rels):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / rel, path / rel)
        except OSError:
            shutil.copyfile(src / rel, path / rel)
    return path


# -- collection -----------------------------------------------------------------------------------
def sizes(store: Store) -> dict[str, int]:
    """Every directory under ``unpacked/`` (by name: an entry key, or leftovers) and its bytes."""
    base = store.base / DIR
    if not base.is_dir():
        return {}
    out = {}
    for p in base.iterdir():
        try:
            out[p.name] = workdirs.tree_size(p) if p.is_dir() else p.lstat().st_size
        except FileNotFoundError:
            continue
    return out


def remove(store: Store, names: Iterable[str]) -> int:
    """Remove ``unpacked/<name>`` for each name unless a process holds it (it is loading from it:
    a later gc takes it); returns the bytes freed."""
    base = store.base / DIR
    freed = 0
    for name in names:
        path = base / name
        if "/" in name or name in ("", ".", ".."):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                freed += workdirs.remove_idle(path)
            elif path.exists() or path.is_symlink():
                size = path.lstat().st_size
                path.unlink()
                freed += size
        except OSError:  # cannot remove now (permissions, busy): left for the next gc
            continue
    return freed
