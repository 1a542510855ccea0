"""The one place aotc changes the process environment that torch reads (Inductor's and Triton's
cache dirs, the tensor-data-pointer hook kernel libraries read when imported): set for a block,
restored after, so nothing leaks into the rest of the process. Its lock (:func:`process_scope`)
is also held by every block that patches Inductor's process-wide config or classes, so a
background thread (the ISA probes and header build of ``header_build``) and the compiling
thread never interleave such blocks (each restores what it saved: interleaved, one would undo
the other's). Tested on torch 2.11–2.13."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_lock = threading.RLock()  # one scope at a time: the environment is the process's


@contextlib.contextmanager
def process_scope() -> Iterator[None]:
    """Hold the lock of torch's process-wide state for the block (re-entrant in one thread):
    whoever changes that state for a block (environment, Inductor's config, a patched torch
    class) holds it, so two threads' blocks run one after the other."""
    with _lock:
        yield


def _apply(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def scoped_env(**values: str | None) -> Iterator[None]:
    """Set each ``NAME=value`` (``None``: unset) for the block; every variable is put back as it
    was when the block ends, however it ends."""
    with _lock:
        saved = {k: os.environ.get(k) for k in values}
        try:
            _apply(values)
            yield
        finally:
            _apply(saved)
