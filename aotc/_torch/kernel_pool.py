"""A pool of C++ kernel libraries shared by the piece compiles of one job, so a kernel two pieces
(or two sizes) have in common is built once: part of the fence around ``torch._inductor``.

Inductor names a C++ kernel's library after the hash of its source and build command
(``<cache dir>/<xx>/<key>.main.so``; only such files are pooled, not the ISA probes) and runs the
compiler only when no file is at that path (``codecache._worker_compile_cpp``; written for torch
2.11–2.13, tested on 2.13.0 CPU). Each compile runs in its own scoped cache dir
(:mod:`aotc._torch.inductor_compile`), so without the pool every piece rebuilt the kernels it
shares with the others: 12 of 48 kernel builds of an 8-layer toy Llama at 5 compile sizes.

:func:`seed` links the pool's libraries into a compile's cache dir *without* their sources;
Inductor writes the source of every kernel it uses (``codecache.write`` runs whether or not the
library exists), so after the compile :func:`prune` drops the seeded libraries whose source was
not written — the compile's kernel files stay exactly the ones it uses — and :func:`add` links
the libraries it built into the pool (after they are on disk: a resumed compile may take them).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

__all__ = ["add", "is_kernel", "prune", "seed"]

_KERNELS = "*.main.so"  # a C++ kernel library, as Inductor names it


def is_kernel(rel: str) -> bool:
    """Whether a file in an Inductor cache dir is a C++ kernel library (what the pool holds)."""
    return rel.endswith(_KERNELS[1:])


def _link(src: Path, dst: Path) -> bool:
    """``dst`` as a hard link to ``src`` (a copy across filesystems); False if ``dst`` exists."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    except OSError:
        partial = dst.with_name(f".{dst.name}.{os.getpid()}.partial")
        shutil.copy2(src, partial)
        os.replace(partial, dst)
    return True


def seed(pool: Path | None, cache_dir: Path) -> set[str]:
    """Link every library of ``pool`` into ``cache_dir`` (relative paths kept); the ones linked."""
    if pool is None or not pool.is_dir():
        return set()
    seeded = set()
    for lib in pool.rglob(_KERNELS):
        rel = lib.relative_to(pool).as_posix()
        if not lib.name.startswith(".") and _link(lib, cache_dir / rel):
            seeded.add(rel)
    return seeded


def prune(cache_dir: Path, seeded: Iterable[str]) -> set[str]:
    """Remove the seeded libraries the compile did not use (no source written beside them);
    returns the ones it used."""
    used = set()
    for rel in seeded:
        lib = cache_dir / rel
        if lib.with_suffix(".cpp").is_file():
            used.add(rel)
        else:
            lib.unlink(missing_ok=True)
    return used


def add(pool: Path | None, root: Path, files: Iterable[str]) -> int:
    """Link the kernel libraries among ``files`` (relative to ``root``) into ``pool``, each made
    durable first; returns how many were new to it."""
    if pool is None:
        return 0
    added = 0
    for rel in files:
        if not is_kernel(rel) or (pool / rel).exists():
            continue
        with open(root / rel, "rb") as fh:
            os.fsync(fh.fileno())
        added += _link(root / rel, pool / rel)
    return added
