"""Advisory file locks inside a store, released by the kernel when their process dies.

Two uses, one mechanism (``fcntl.flock`` on ``<root>/store-v1/locks/<kind>-<key>``):

- a **build lease** (``kind="build"``, exclusive): the process about to compile a key holds it; the
  other processes sharing this store wait on it and then load what it stored — one compile per
  node, as a remote's lease gives one per fleet (:mod:`aotc.fleet.lease`);
- a **hold** (``kind="hold"``, shared): a process serving an entry holds it for as long as it
  serves; eviction (``AOTC_MAX_SIZE``) takes it exclusively without waiting and skips the entry
  when it cannot.

A killed process (SIGKILL, OOM) releases its locks with its file descriptors: no stale lock to
expire. The lock files themselves are empty; eviction and ``aotc gc`` remove those of entries
that are gone, holding them exclusively, and a process that opened one just before and then got
it finds it removed and locks the file the path names now (``FileLock.acquire``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

__all__ = ["FileLock", "hold", "is_held", "lock_path", "release_hold"]


def lock_path(base: Path, kind: str, key: str) -> Path:
    """The lock file for ``kind`` (``build``, ``hold``) of ``key`` under a store's ``base``
    (``<root>/store-v1``)."""
    return base / "locks" / f"{kind}-{key}"


class FileLock:
    """One ``flock`` on ``path`` (created with its folder when missing). Not re-entrant; one
    object per holder. ``acquire`` returns whether it got the lock; ``release`` is idempotent."""

    def __init__(self, path: Path, shared: bool = False) -> None:
        self.path = path
        self.shared = shared
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds its lock now."""
        return self._fd is not None

    def acquire(self, timeout: float | None = 0.0, poll: float = 0.05) -> bool:
        """Take the lock: at once (``timeout=0``), within ``timeout`` seconds, or waiting as long
        as it takes (``None``). False when it was not got in time. A lock file removed (or
        replaced) while this process waited for it is opened again: the lock is always on the
        file the path names now (``aotc gc`` removes lock files of entries that are gone)."""
        if self._fd is not None:
            return True
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, mode | fcntl.LOCK_NB)
                        break
                    except OSError as e:
                        if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                            raise
                    if deadline is not None and time.monotonic() >= deadline:
                        os.close(fd)
                        return False
                    time.sleep(poll if deadline is None
                               else max(0.0, min(poll, deadline - time.monotonic())))
                if _same_file(self.path, fd):
                    self._fd = fd
                    return True
                os.close(fd)  # removed or replaced while we waited: lock the file there now
            except BaseException:
                if self._fd is None:
                    os.close(fd)
                raise

    def release(self) -> None:
        """Let go (closing the descriptor releases the lock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire(timeout=None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


# -- holds: a serving process holds what it loaded until it exits ---------------------------------
_HOLDS: dict[tuple[str, str], FileLock] = {}
_HOLDS_LOCK = threading.Lock()


def hold(base: Path, key: str, timeout: float = 30.0) -> bool:
    """Hold entry ``key`` of the store at ``base`` (a shared ``hold-<key>`` lock) from now until
    this process exits: eviction (``AOTC_MAX_SIZE``, ``aotc gc --max-size``) skips it. Taken once
    per process and key. Waits at most ``timeout`` seconds for an eviction deleting the entry
    right now (a later read of it is then a clean miss). False when it could not be taken (a
    read-only store, a timeout): the ``--min-idle`` grace still protects a fresh load."""
    name = (str(base), key)
    with _HOLDS_LOCK:
        if name in _HOLDS:
            return True
    lock = FileLock(lock_path(base, "hold", key), shared=True)
    try:
        if not lock.acquire(timeout=timeout):
            return False
    except OSError:
        return False
    with _HOLDS_LOCK:
        if name in _HOLDS:  # another thread took it meanwhile
            lock.release()
        else:
            _HOLDS[name] = lock
    return True


def release_hold(base: Path, key: str) -> None:
    """Let go of this process's hold on entry ``key`` (a process that stops serving it)."""
    with _HOLDS_LOCK:
        lock = _HOLDS.pop((str(base), key), None)
    if lock is not None:
        lock.release()


def is_held(base: Path, key: str) -> bool:
    """Whether a process (this one included) holds entry ``key``: an exclusive lock cannot be
    taken at once. Probes without waiting and lets go."""
    probe = FileLock(lock_path(base, "hold", key))
    try:
        if not probe.acquire(timeout=0):
            return True
    except OSError:
        return False  # no lock folder we can write: nobody can hold one there either
    probe.release()
    return False
