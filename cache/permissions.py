"""Who may write a store: ssh's ``StrictModes`` for the directories code is loaded from.

A store's entries are code a loader unpickles or dlopens. Blobs are checked by hash, and
signatures (a trust policy with keys) vouch for entries; without signatures, the index is the
authority, so anyone who can write it — or add blobs, or swap an unpacked file — can plant code.
:func:`unsafe_paths` lists the parts of a store that someone other than this user (or root) could
write: each of the store root, ``store-v1/``, ``index.sqlite`` (and its ``-wal``/``-shm`` when
present), ``blobs/``, ``unpacked/`` and ``tmp/`` (staging, compile work dirs, private load dirs)
must be owned by the current user or root and not writable by its group or others. What lies
below those directories was made by aotc under them (nobody else could add to them) and is
re-hashed before use.

A group-writable path passes when its group is a user-private group whose only member is the
path's owner (the scheme of Debian/Ubuntu's ``umask 002`` login sessions; Debian's OpenSSH
allows it too). A path that does not exist is skipped; one that cannot be stat-ed is skipped
(the load that needs it fails on its own). A few ``stat`` calls: cheap enough for every store
open. Stdlib only: what to do about a finding (refuse, unless signatures are required) is the
trust policy's (``aotc.fleet.trust``).
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["STORE_PARTS", "UnsafePath", "unsafe_paths"]

# relative to the store root; "" is the root itself
STORE_PARTS = (
    "",
    "store-v1",
    "store-v1/index.sqlite",
    "store-v1/index.sqlite-wal",
    "store-v1/index.sqlite-shm",
    "store-v1/blobs",
    "store-v1/unpacked",
    "store-v1/tmp",
)


@dataclass(frozen=True)
class UnsafePath:
    """A part of a store others could write: its ``path``, ``mode`` (permission bits), owner
    ``uid`` and what is wrong (``foreign_owner``: owned by neither this user nor root;
    ``group_writable``, ``other_writable``)."""

    path: Path
    mode: int
    uid: int
    foreign_owner: bool
    group_writable: bool
    other_writable: bool

    @property
    def mode_str(self) -> str:
        """The permission bits as ``chmod`` takes them, e.g. ``0777``."""
        return f"{self.mode & 0o7777:04o}"

    def describe(self) -> str:
        """``PATH is mode 0777 (writable by others)`` / ``… owned by uid 12345 …``."""
        why = []
        if self.foreign_owner:
            why.append(f"owned by uid {self.uid}")
        if self.other_writable:
            why.append("writable by others")
        elif self.group_writable:
            why.append("writable by its group")
        return f"{self.path} is mode {self.mode_str} ({', '.join(why)})"


def unsafe_paths(root: str | os.PathLike[str], uid: int | None = None) -> list[UnsafePath]:
    """The parts of the store at ``root`` (:data:`STORE_PARTS`) that a user other than ``uid``
    (default: this process's effective user) and root could write (module doc); empty when the
    store is safe to load code from, or on a platform without Unix owners."""
    if uid is None:
        if not hasattr(os, "geteuid"):  # pragma: no cover - no Unix owners (Windows)
            return []
        uid = os.geteuid()
    base = Path(root)
    out = []
    for part in STORE_PARTS:
        path = base / part if part else base
        try:
            st = os.stat(path)
        except OSError:  # missing (no WAL, no unpacked/ yet) or not ours to see: nothing to judge
            continue
        foreign = st.st_uid not in (uid, 0)
        others = bool(st.st_mode & stat.S_IWOTH)
        group = bool(st.st_mode & stat.S_IWGRP) and not _private_group(st.st_gid, st.st_uid)
        if foreign or others or group:
            out.append(UnsafePath(path, stat.S_IMODE(st.st_mode), st.st_uid, foreign, group, others))
    return out


@functools.lru_cache(maxsize=64)
def _private_group(gid: int, owner: int) -> bool:
    """Whether group ``gid`` has exactly one member, ``owner`` (as its primary group or its only
    listed member): a user-private group, whose write bit lets in no one else."""
    try:
        import grp
        import pwd
    except ImportError:  # pragma: no cover - no Unix groups
        return False
    try:
        group = grp.getgrgid(gid)
        name = pwd.getpwuid(owner).pw_name
    except KeyError:  # an unnamed group or owner: nothing says who else is in it
        return False
    primary = {p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid}  # users whose group it is
    if primary - {owner}:
        return False
    members = set(group.gr_mem) | ({name} if primary else set())
    return members == {name}
