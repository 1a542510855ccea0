"""Advisory file locks inside a store, released by the kernel when their process dies.

Two uses, one mechanism (``fcntl.flock`` on ``<root>/store-v1/locks/<kind>-<key>``):

- a **build lease** (``kind="build"``, exclusive): the process about to compile a key holds it; the
  other processes sharing this store wait on it and then load what it stored — one compile per
  node, as a remote's lease gives one per fleet (:mod:`aotc.fleet.lease`);
- a **hold** (``kind="hold"``, shared): a process serving an entry holds it for as long as it
  serves; eviction (``AOTC_MAX_SIZE``) takes it exclusively without waiting and skips the entry
  when it cannot.

A killed process (SIGKILL, OOM) releases its locks with its file descriptors: no stale lock to
expire. The lock files themselves are empty and left in place (removing one would race a
process that just opened it); ``aotc gc`` removes those of entries that are gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

__all__ = ["FileLock", "lock_path"]


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
        as it takes (``None``). False when it was not got in time."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    self._fd = fd
                    return True
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                        raise
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))
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
