"""A split graph's merged program: the same graph compiled whole, stored beside its pieces, and
served instead of them where nothing is captured (CPU).

The split at attention is for the GPU (piecewise CUDA graphs around an attention that cannot be
captured) and for the cold compile (each unique piece compiled once). Where nothing is captured
it costs at run time: each piece allocates its own buffers (Inductor reuses buffers across a
whole graph's layers) and is called through its own wrapper — ~2 % of a small Llama's CPU decode
step (``bench/hf_generate.py``: pieces 0.99× Inductor, one piece 1.01×). So after a CPU graph
with attention is compiled in pieces and served, a child process forked at that point (it holds
the graph and its example inputs in memory: nothing is re-traced or sent) compiles it once more
with no splitting ops, at a lower CPU priority, checks it against the graph run eagerly like any
entry, and stores it under the key the backend gives the graph with no splitting ops (the pieces'
factors with ``backend.splitting_ops`` empty: what ``aotc.backend(splitting_ops=[])`` stores). A later
start that finds it serves it instead of the pieces; the first start is never slowed or made to
wait (the pieces serve it meanwhile). A start that loads the pieces and finds no merged program
(a store from before, ``AOTC_MERGE=0`` then, another machine's push without one) starts the same
child. A merge that fails is remembered (:mod:`aotc.backend.given_up`) and not tried again by
this aotc; a damaged merged entry is skipped with one line and the pieces serve.

Where not (the entry's ``mergeable``, :func:`aotc.backend.build.build_entry`): a graph that was
not split (nothing to merge), a training graph, a graph whose splitting op writes into a buffer
the graph allocates (vLLM's attention: the check zeroes that buffer before the op, which it
cannot do inside a whole compiled graph, so such a program could not be checked); nor a graph on
another device than the CPU (CUDA graphs want the pieces; a CUDA context does not survive a
fork), a process that cannot fork, ``AOTC_MERGE=0``. The child leaves with ``os._exit`` and is killed by
its own alarm after :data:`TIME_LIMIT` seconds; :func:`wait_for_merges` waits for this process's.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotc.log import logger

__all__ = ["TIME_LIMIT", "merge_later", "merge_wanted", "merged_entry", "merged_factors", "merged_key",
           "start_merge", "wait_for_merges"]

_log = logger("backend")
TIME_LIMIT = 3600  # seconds a merge child may run before its alarm ends it
_running: dict[int, threading.Thread] = {}  # this process's merge children, by pid: their reapers


def merged_factors(factors: dict[str, Any]) -> dict[str, Any]:
    """The merged program's factors: the pieces' (``factors``) with no splitting ops — the graph
    as ``aotc.backend(splitting_ops=[])`` keys it, so either stores the same entry."""
    return {**factors, "backend": {**factors["backend"], "splitting_ops": []}}


def merged_key(factors: dict[str, Any]) -> str:
    """The store key of the merged program of the graph whose pieces have ``factors``."""
    from aotc.records.key import compute_key

    return compute_key(merged_factors(factors))


def merge_wanted(enabled: bool, example_inputs: Sequence[Any], metadata: dict[str, Any]) -> bool:
    """Whether a graph whose pieces' entry has ``metadata`` gets a merged program (module doc)."""
    if not (enabled and metadata.get("mergeable")):
        return False
    from aotc._torch.forked import fork_is_safe
    from aotc.backend.graphkey import graph_device

    return graph_device(example_inputs) == "cpu" and fork_is_safe()


def merged_entry(tiered: Any, factors: dict[str, Any], pulled: bool) -> Any:
    """The stored merged program of the graph whose pieces have ``factors``, or None: from the
    local store, or — when the pieces were just ``pulled`` from the remote — pulled too."""
    from aotc.errors import AotcError

    key = merged_key(factors)
    try:
        if tiered.has(key) or (pulled and tiered.remote is not None):
            return tiered.get(key, wait=False)
    except AotcError as e:
        if type(e).__name__ != "CacheMiss":
            _log.warning(f"aotc: warning: merged program {key[:16]}… not taken ({_one_line(e)}); "
                         "the pieces serve the graph")
    return None


def _claim(lock: Path) -> int | None:
    """An exclusive ``flock`` on ``lock`` (its fd), or None when another process holds it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def merge_later(gm: Any, example_inputs: Sequence[Any], pieces_key: str, factors: dict[str, Any],
                metadata: dict[str, Any], cfg: Any, context: Any, tiered: Any,
                compile_and_store: Callable[..., dict[str, Any]]) -> int | None:
    """Compile the graph whole in a forked child and store it beside its pieces (their entry's
    ``pieces_key``, ``factors``, ``metadata``; the backend's ``cfg`` and ``context``; ``tiered``:
    the store they came from), when it is wanted and neither stored nor given up on (module
    doc). ``compile_and_store(gm, inputs, key, factors, store, cfg, context, tolerance)``
    compiles, checks and stores one graph (the backend's miss). The child's pid, or None."""
    if not merge_wanted(cfg.merges(context.settings), example_inputs, metadata):
        return None
    from dataclasses import replace

    from aotc.backend.build import computed_float_dtype
    from aotc.backend.given_up import GivenUpBefore, raise_if_given_up, remember

    key = merged_key(factors)
    trusted = not tiered.policy.keys or (context.signer is not None
                                         and context.signer.public in tiered.policy.keys)
    if tiered.has(key) or tiered.local.read_only or not trusted:
        return None
    tolerance = cfg.tolerance_for(computed_float_dtype(gm, example_inputs))
    try:
        raise_if_given_up(tiered.local, key, tolerance)
    except GivenUpBefore:
        return None
    whole = replace(cfg, splitting_ops=())
    # the child opens its own store and remote: no sqlite connection or socket crosses the fork
    theirs = replace(context, store=str(tiered.local.root),
                     remote=getattr(tiered.remote, "url", None) if tiered.remote is not None else None)

    def build() -> None:
        from aotc.fleet.tiered import Wanted

        mine = theirs.open_tiered(create=True)
        try:
            mine.get_or_build(Wanted.by_key(key, f"merged program {key[:16]}…"), lambda: _Stored(
                key, compile_and_store(gm, example_inputs, key, merged_factors(factors), mine.local,
                                       whole, theirs, tolerance)))
        except BaseException as e:
            remember(mine.local, cfg.name, gm, example_inputs, key, e, tolerance)
            raise

    return start_merge(f"graph {pieces_key[:16]}…: merged program {key[:16]}…", build,
                       tiered.local.tmp_dir / f"merge-{key[:32]}.lock")


def start_merge(label: str, build: Callable[[], None], lock: Path) -> int | None:
    """Fork a child that runs ``build()`` (compile the merged program and store it; on failure
    remember it and raise) and leaves, saying in one line how it went. The child holds an
    exclusive lock on the file ``lock`` while it works: a process that finds it held starts
    none (a restart while the first start's child still compiles). Returns the child's pid
    (None: none started — the pieces serve, nothing else happens)."""
    from aotc._torch import forked
    from aotc._torch.scoped_env import process_scope

    try:
        fd = _claim(lock)
        if fd is None:
            _log.info(f"aotc: {label}: another process is compiling it")
            return None
        try:
            with process_scope():  # no thread of ours is inside Inductor's state at the fork
                pid = os.fork()
        except OSError:
            os.close(fd)
            raise
    except OSError as e:
        _log.warning(f"aotc: warning: {label}: no merged program ({_one_line(e)}); the pieces serve it")
        return None
    if pid != 0:
        os.close(fd)  # the child holds the lock (the same open file) until it leaves
    if pid == 0:  # the child
        code = 1
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
                signal.signal(sig, signal.SIG_DFL)  # not the server's handlers
            signal.alarm(TIME_LIMIT)
            os.nice(10)
            forked.after_fork_in_child()
            t = time.perf_counter()
            build()
            _log.info(f"aotc: {label}: merged program compiled, checked, stored in "
                      f"{time.perf_counter() - t:.1f}s (pid {os.getpid()})")
            code = 0
        except BaseException as e:  # noqa: BLE001 - a child: say why and leave
            _log.warning(f"aotc: warning: {label}: no merged program ({_one_line(e)}); the pieces "
                         "serve it")
        finally:
            try:
                lock.unlink()  # (a process that opened it meanwhile locks a file nobody waits on)
            except OSError:
                pass
            os._exit(code)
    reaper = threading.Thread(target=_reap, args=(pid,), name=f"aotc-merge-{pid}", daemon=True)
    _running[pid] = reaper
    reaper.start()
    _log.info(f"aotc: {label}: merged program compiling in the background (pid {pid})")
    return pid


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler of the server's)
        pass
    finally:
        _running.pop(pid, None)


def wait_for_merges(timeout: float | None = None) -> bool:
    """Wait for the merged-program compiles this process started (at most ``timeout`` seconds in
    all); True when none is left running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in list(_running.values()):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        thread.join(left)
    return not _running


@dataclass(frozen=True)
class _Stored:
    """What the merge's build stored (the tiered store pushes it by ``key``)."""

    key: str
    metadata: dict[str, Any]


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]
