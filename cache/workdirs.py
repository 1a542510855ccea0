"""Compile work directories: ``<store>/store-v1/tmp/compile-<key>/``, what a compile has finished so
far (one subdirectory per compiled piece and size), so that a compile killed half-way resumes where
it stopped instead of starting over.

Every process working in a directory holds a shared ``flock`` on its ``.lock`` file; whoever
finishes last (an exclusive lock is then free) removes the directory, and ``gc`` removes one that
nobody holds and whose newest file is older than the staging grace. A process that finds the
lock file replaced under it (the directory was removed and recreated meanwhile) takes the new one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".lock"
PREFIX = "compile-"


class WorkDir:
    """A claimed work directory; call ``finished()`` to have it removed on release when no other
    process still works in it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd, self._remove = path, fd, False

    def finished(self) -> None:
        self._remove = True

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._remove:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else in it
                    _remove(self.path)
                except BlockingIOError:
                    pass  # another compile still uses the pieces; the last one out removes it
        finally:
            os.close(self._fd)
            self._fd = -1


@contextmanager
def claim(tmp_dir: Path, name: str) -> Iterator[WorkDir]:
    """Enter ``tmp_dir/compile-<name>`` (created if absent) holding a shared lock on it."""
    path = tmp_dir / f"{PREFIX}{name}"
    for _attempt in range(100):
        path.mkdir(parents=True, exist_ok=True)
        lock = path / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # removed between mkdir and open: again
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the directory was removed while we waited for the lock: take the new one
    else:  # pragma: no cover - a pathological race
        raise OSError(f"could not claim compile work directory {path}")
    work = WorkDir(path, fd)
    try:
        yield work
    finally:
        work.release()


def is_workdir(path: Path) -> bool:
    return path.is_dir() and path.name.startswith(PREFIX)


def newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, n)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except FileNotFoundError:
                continue
    return total


def in_use(path: Path) -> bool:
    """True when a live process holds the directory's lock."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_idle(path: Path) -> int:
    """Remove a work directory unless a process holds it; returns the bytes freed."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 0
    try:
        size = tree_size(path)
        _remove(path)
        return size
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Rename first, then delete: a kill during the deletion leaves a directory no compile will
    resume from (half its files gone), only gc's to collect."""
    if ".removing-" not in path.name:
        gone = path.with_name(f"{path.name}.removing-{os.getpid()}")
        try:
            os.rename(path, gone)
        except OSError:
            return
        path = gone
    shutil.rmtree(path, ignore_errors=True)


def stale(path: Path, cutoff: float) -> bool:
    """An idle work directory whose newest file is older than ``cutoff`` (a time)."""
    try:
        return newest_mtime(path) <= cutoff and not in_use(path)
    except FileNotFoundError:
        return False


__all__ = ["WorkDir", "claim", "in_use", "is_workdir", "remove_idle", "stale", "tree_size"]
