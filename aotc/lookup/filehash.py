"""sha256 of source files, remembered in this process per file identity: a compile and the
lookups around it hash the same traced files more than once.

A file's identity is (device, inode, size, mtime_ns, ctime_ns): any write changes ctime, which
no user call can set back, so a changed file never matches a remembered digest.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_memo: dict[str, tuple[tuple[int, ...], str]] = {}


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of ``path``'s bytes, from the memo when the file is unchanged."""
    real = os.path.realpath(path)
    ident = _identity(os.stat(real))
    hit = _memo.get(real)
    if hit is not None and hit[0] == ident:
        return hit[1]
    with open(real, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if _identity(os.stat(real)) == ident:  # not written while we read it
        _memo[real] = (ident, digest)
    return digest


def is_toolchain_file(path: str) -> bool:
    """Whether a traced source file is covered by the toolchain factors (torch itself, the
    stdlib) rather than by an entry's ``code`` factor."""
    import torch

    real = os.path.realpath(path)
    torch_root = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    stdlib = os.path.realpath(os.path.dirname(os.__file__)) + os.sep
    in_site = "site-packages" in real or "dist-packages" in real
    return real.startswith(torch_root) or (real.startswith(stdlib) and not in_site)
