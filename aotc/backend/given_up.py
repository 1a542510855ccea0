"""Graphs the backend gave up on, remembered in the store (:mod:`aotc.cache.failures`): a graph
that could not be split, compiled or checked is recorded with aotc's compile-logic version, the
check's tolerance and the reason, and its compile work directory is removed; the next process
that meets the key — and finds no entry in the remote either — falls back at once
(:func:`raise_if_given_up`), with one line naming the recorded reason: no split, compile or
check. ``aotc gc`` forgets them all; a new aotc (another compile-logic hash) or another tolerance
tries again. A graph that cannot be keyed is recorded under its fingerprint for ``aotc inspect
cache`` (keying it fails again at once, before any work).

Only failures that would repeat are remembered: not an unreachable or refused remote, a store
that cannot be written, a trust policy, a full disk, memory, a killed compile worker."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from aotc.cache import failures
from aotc.errors import (
    AotcError,
    BackendError,
    CaptureError,
    CompileError,
    LoadError,
    NumericMismatchError,
    RunError,
    SplitError,
)
from aotc.log import logger

__all__ = ["GivenUpBefore", "failure_version", "forget", "graph_fingerprint", "raise_if_given_up", "remember",
           "repeats"]

_log = logger("backend")
_REPEATS = (BackendError, CaptureError, CompileError, LoadError, NumericMismatchError, RunError, SplitError)


class GivenUpBefore(BackendError):
    """The store remembers that this graph could not be served (see module doc)."""


def _version(tolerance: Any) -> str:
    """aotc's compile-logic hash and the check's tolerance: another aotc, or a graph given
    another tolerance (a failed check says to), tries again."""
    from aotc.lookup.compile_logic import compile_logic_hash

    return compile_logic_hash() + ("" if tolerance is None else f":tolerance={list(tolerance)}")


def _transient(e: BaseException) -> bool:
    """An error of the machine, not of the graph: out of disk or memory (torch's out-of-memory
    error too), a compile worker killed (a broken process pool) — anywhere in the chain."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        name = type(cur).__name__
        if isinstance(cur, (OSError, MemoryError)) or name in ("OutOfMemoryError", "BrokenProcessPool") \
                or "out of memory" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def failure_version(tolerance: Any = None) -> str:
    """The version a failure of a graph compiled with ``tolerance`` is remembered under."""
    return _version(tolerance)


def repeats(e: BaseException) -> bool:
    """Whether ``e`` would fail the same graph again: worth remembering (module doc)."""
    return _repeats(e)


def _repeats(e: BaseException) -> bool:
    """Whether ``e`` would fail the same graph again (module doc)."""
    if isinstance(e, GivenUpBefore) or _transient(e):
        return False
    return isinstance(e, _REPEATS) or not isinstance(e, AotcError)


def graph_fingerprint(gm: Any, example_inputs: Sequence[Any]) -> str:
    """The name a graph that could not be keyed is remembered by: its FX code and its inputs'
    types, dtypes and shapes."""
    h = hashlib.sha256(str(getattr(gm, "code", "")).encode())
    for x in example_inputs:
        h.update(f"{type(x).__name__}:{getattr(x, 'dtype', '')}:{list(getattr(x, 'shape', ()))}".encode())
    return "unkeyed-" + h.hexdigest()


def raise_if_given_up(store: Any, key: str, tolerance: Any = None) -> None:
    """Raise :class:`GivenUpBefore` naming the recorded reason when ``store`` remembers ``key``
    (compiled with ``tolerance``)."""
    try:
        found = failures.lookup(store, key, _version(tolerance))
    except AotcError as e:  # an unreadable index: try the graph as if nothing were remembered
        _log.warning(f"aotc: warning: cannot read the remembered failures of {store.root}: {e}")
        return
    if found is not None:
        raise GivenUpBefore(f"aotc gave up on this graph before ({found.tries} tr"
                            f"{'y' if found.tries == 1 else 'ies'}; `aotc gc` forgets it): {found.reason}")


def remember(store: Any, name: str, gm: Any, example_inputs: Sequence[Any], key: str,
             error: BaseException, tolerance: Any = None) -> None:
    """Record ``error`` for the graph (``key``, else its fingerprint) in the local ``store`` (None:
    it could not be opened — nothing to do) and remove the compile work directory the try left;
    never raises."""
    if store is None or not _repeats(error):
        return
    try:
        from aotc.cache import workdirs

        reason = f"{type(error).__name__}: {error}"
        failures.remember(store, key or graph_fingerprint(gm, example_inputs), name, _version(tolerance),
                          reason)
        if key:
            workdirs.remove_idle(store.tmp_dir / f"{workdirs.PREFIX}{key[:32]}")
    except Exception as e:  # noqa: BLE001 - remembering is a courtesy: the fallback goes on
        _log.warning(f"aotc: warning: could not remember the failure in the store: {type(e).__name__}: {e}")


def forget(store: Any, key: str) -> None:
    """The graph was stored after all: forget any failure remembered for it."""
    try:
        failures.forget(store, key)
    except AotcError:
        pass  # nothing remembered can be read: nothing to forget
