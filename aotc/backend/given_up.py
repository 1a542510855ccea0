"""Graphs the backend gave up on, remembered in the store (:mod:`aotc.cache.failures`): a graph
that could not be split, compiled or checked is recorded with aotc's compile-logic version, the
check's tolerance, the reason and its reason class, and its compile work directory is removed;
the next process that meets the key — and finds no entry in the remote either — falls back at
once (:func:`raise_if_given_up`), with one line naming the recorded reason: no split, compile or
check. ``aotc gc`` forgets them all; a new aotc (another compile-logic hash) or another tolerance
tries again. A graph that cannot be keyed is recorded under its fingerprint for ``aotc inspect
cache`` (keying it fails again at once, before any work: its row is never looked up).

The reason class (:func:`reason_class`) says how long a failure is remembered:

- ``repeats``: aotc's own verdict that the graph cannot be served — an op it cannot key, a graph
  it cannot split, a numeric mismatch, an unsupported construct (the ``_REPEATS`` errors, raised
  by aotc itself): remembered until aotc's code or the tolerance changes (another toolchain keys
  the graph anew).
- ``unknown``: any other error — another library's, or one of aotc's errors raised from one
  (``raise CompileError(...) from e``: Inductor failed, the C++ compiler was killed by a signal):
  retried with backoff (:func:`aotc.cache.failures.backoff`: 1 hour after the first failure, then
  4, 16, 64 hours, at most a week), never remembered for good. A lookup whose retry is due does
  not fall back: the graph is compiled again; a new failure counts one more attempt (a longer
  backoff), a success forgets the row (:func:`forget`).

Not remembered at all, because they do not repeat: an unreachable or refused remote, a store
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

__all__ = ["GivenUpBefore", "failure_version", "forget", "graph_fingerprint", "raise_if_given_up", "reason_class",
           "remember"]

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


def _wraps_foreign(e: BaseException) -> bool:
    """Whether ``e`` was raised from (``raise … from``) an error that is not aotc's, anywhere in
    its chain of causes: then it says another library failed, not that the graph cannot be served."""
    seen: set[int] = set()
    cur = e.__cause__
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if not isinstance(cur, AotcError):
            return True
        cur = cur.__cause__
    return False


def failure_version(tolerance: Any = None) -> str:
    """The version a failure of a graph compiled with ``tolerance`` is remembered under."""
    return _version(tolerance)


def reason_class(e: BaseException) -> str | None:
    """``e``'s reason class (module doc): ``failures.REPEATS``, ``failures.UNKNOWN``, or None
    when it is not remembered (the machine's error, a setting's, a fallback's own)."""
    if isinstance(e, GivenUpBefore) or _transient(e):
        return None
    if isinstance(e, _REPEATS):
        return failures.UNKNOWN if _wraps_foreign(e) else failures.REPEATS
    return None if isinstance(e, AotcError) else failures.UNKNOWN


def graph_fingerprint(gm: Any, example_inputs: Sequence[Any]) -> str:
    """The name a graph that could not be keyed is remembered by: its FX code and its inputs'
    types, dtypes and shapes."""
    h = hashlib.sha256(str(getattr(gm, "code", "")).encode())
    for x in example_inputs:
        h.update(f"{type(x).__name__}:{getattr(x, 'dtype', '')}:{list(getattr(x, 'shape', ()))}".encode())
    return "unkeyed-" + h.hexdigest()


def raise_if_given_up(store: Any, key: str, tolerance: Any = None, now: float | None = None) -> None:
    """Raise :class:`GivenUpBefore` naming the recorded reason when ``store`` remembers ``key``
    (compiled with ``tolerance``) — unless it is an unknown failure whose retry is due at ``now``
    (default: the clock): then return, and the graph is compiled again."""
    try:
        found = failures.lookup(store, key, _version(tolerance))
    except AotcError as e:  # an unreadable index: try the graph as if nothing were remembered
        _log.warning(f"aotc: warning: cannot read the remembered failures of {store.root}: {e}")
        return
    if found is None:
        return
    if found.due(now):
        _log.info(f"aotc: graph {key[:16]}… failed before for an unknown reason ({_tries(found.attempts)}: "
                  f"{found.reason}); its retry is due: compiling it again")
        return
    if found.reason_class == failures.REPEATS:
        count, when = found.tries, "known to repeat: kept until aotc or its toolchain changes"
    else:
        count, when = found.attempts, f"unknown cause: tried again {found.next_retry_str(now)}"
    raise GivenUpBefore(f"aotc gave up on this graph before ({_tries(count)}; {when}; `aotc gc` "
                        f"forgets it): {found.reason}")


def _tries(n: int) -> str:
    return f"{n} tr{'y' if n == 1 else 'ies'}"


def remember(store: Any, name: str, gm: Any, example_inputs: Sequence[Any], key: str,
             error: BaseException, tolerance: Any = None, now: float | None = None) -> None:
    """Record ``error`` (failed at ``now``, default the clock) for the graph (``key``, else its
    fingerprint) in the local ``store`` (None: it could not be opened — nothing to do) with its
    reason class, and remove the compile work directory the try left; never raises. A graph
    that could not be keyed is of the class ``repeats`` whatever failed: nothing looks its row
    up (keying runs again at every start), so a retry time would mean nothing."""
    cls = reason_class(error)
    if store is None or cls is None:
        return
    try:
        from aotc.cache import workdirs

        reason = f"{type(error).__name__}: {error}"
        failures.remember(store, key or graph_fingerprint(gm, example_inputs), name, _version(tolerance),
                          reason, cls if key else failures.REPEATS, now)
        if key:
            workdirs.remove_idle(store.tmp_dir / f"{workdirs.PREFIX}{key[:32]}")
    except Exception as e:  # noqa: BLE001 - remembering is a courtesy: the fallback goes on
        _log.warning(f"aotc: warning: could not remember the failure in the store: {type(e).__name__}: {e}")


def forget(store: Any, key: str) -> None:
    """The graph was stored after all (an unknown failure's retry succeeded, say): forget any
    failure remembered for it."""
    try:
        failures.forget(store, key)
    except AotcError:
        pass  # nothing remembered can be read: nothing to forget
