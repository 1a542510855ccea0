"""What a process forked from a compiling process resets before it compiles: part of the fence
around ``torch._inductor``. Written for torch 2.11–2.13, tested on 2.13.0 (CPU, GNU OpenMP).

A compile forks its ``-j`` workers after the split (``aotc.compile.workers``), so each child
has the traced pieces in memory. Two things a fork leaves broken in the child:

* **OpenMP's thread team.** GNU OpenMP (``libgomp``, which torch's Linux wheels bundle) keeps
  the parent's worker threads in a pool; a child has none of those threads, and its first
  parallel region waits for them forever — an Inductor kernel's ``#pragma omp parallel
  num_threads(N)`` as much as an ATen op. Setting OpenMP's *max active levels* to 0 makes every
  region inactive: it runs on the calling thread alone, and nothing waits for the pool. The
  thread count torch reports is left as it is, because Inductor writes it into the kernels it
  generates (``parallel_num_threads``): a child generates the same code as its parent.
* **Inductor's kernel-build thread pool** (``AsyncCompile.pool``, cached once per process): the
  child's copy counts the parent's idle threads, so work given to it never starts. Inductor
  resets its process pool at a fork itself; the thread pool is cleared here.

A CUDA context does not survive a fork at all: once CUDA is initialized, :func:`fork_is_safe`
says no and the compile runs in one process.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["after_fork_in_child", "fork_is_safe", "openmp_runtimes"]

# the OpenMP runtimes torch builds link against, by the name a loaded one answers to
_OPENMP_NAMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so", "libomp.dylib",
                 "libiomp5.dylib")


def openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes loaded in this process (none is loaded by asking)."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    found: list[ctypes.CDLL] = []
    for name in _OPENMP_NAMES:
        try:
            found.append(ctypes.CDLL(name, mode=mode))
        except OSError:
            continue
    return found


def fork_is_safe() -> bool:
    """Whether this process may fork compile workers: not once CUDA is initialized here (a
    CUDA context does not survive a fork; a CUDA compile runs in one process)."""
    import torch

    return hasattr(os, "fork") and not torch.cuda.is_initialized()


def after_fork_in_child() -> None:
    """Make a freshly forked child safe to compile and run kernels in (see the module doc):
    OpenMP regions run on one thread, Inductor's kernel-build thread pool starts anew."""
    for lib in openmp_runtimes():
        setter = getattr(lib, "omp_set_max_active_levels", None)
        if setter is not None:
            setter(ctypes.c_int(0))
    from torch._inductor.async_compile import AsyncCompile

    pool: object = getattr(AsyncCompile, "pool", None)
    clear = getattr(pool, "cache_clear", None)
    if clear is not None:
        clear()
