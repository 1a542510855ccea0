"""The process that compiles a merged program (:mod:`aotc.backend.merged`): forked from the
serving process, so it holds the graph and its example inputs without a re-trace.

What a fork would otherwise break or leak, and how the child avoids it:

* **SQLite.** SQLite's per-file lock bookkeeping lives in the process's memory; a child that
  opened the store's index anew would inherit the parent's (locks the child does not hold,
  the WAL's shared-memory state) and could write unlocked once the parent exits. So the child
  touches no store the parent has open: it compiles, checks and stores into a *staging* store
  of its own (a new directory under the store's ``tmp``), then ``exec``s a fresh interpreter
  (``python -m aotc.backend.merge_child STAGING``) that copies the entry into the real store —
  signed when a signing key is set, pushed when a remote is — or records the failure, and
  removes the staging directory. The fresh interpreter also outlives the parent safely.
* **File descriptors.** stdin and stdout become ``/dev/null`` (a server may speak on stdout) and
  stderr a log file beside the lock (``merge-<key>.log``): a caller that reads the parent's
  output to its end (``subprocess.run(capture_output=True)``) is not held open by the child.
  Python's own descriptors are not inherited by the ``exec``.
* **Signals, priority, time.** The server's handlers are reset to the defaults, the child runs
  at a lower priority (``nice 10``) and its alarm ends it after :data:`TIME_LIMIT` seconds.
* **One at a time.** The child and its ``exec``'d copy hold an exclusive ``flock`` on
  ``merge-<key>.lock`` in the store's ``tmp``: another process (a restart while the first start's
  child compiles) starts none; the file counts the attempts started, so a child killed (the
  alarm, memory) is tried at most :data:`MAX_ATTEMPTS` times until ``aotc gc`` removes the idle
  file. One child per process at a time: a graph that finds one running is merged at a later start.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aotc.errors import one_line
from aotc.log import logger

__all__ = ["MAX_ATTEMPTS", "TIME_LIMIT", "MergeJob", "start", "wait_for_merges"]

_log = logger("backend")
TIME_LIMIT = 1800  # seconds a merge child may run (below the store's tmp grace: gc keeps its lock)
MAX_ATTEMPTS = 2  # merges of one key started in one store before it is left alone (until gc)
_running: dict[int, threading.Thread] = {}  # this process's merge children, by pid: their reapers


@dataclass(frozen=True)
class MergeJob:
    """One merged program to compile: its ``key`` and entry ``name``, the real store
    (``store_root``, ``tmp_dir``) and remote (``remote_url``) it goes to, and the version a
    failure is remembered under (:func:`aotc.backend.given_up.failure_version`)."""

    label: str
    key: str
    name: str
    store_root: str
    tmp_dir: str
    remote_url: str | None
    version: str

    @property
    def lock(self) -> Path:
        return Path(self.tmp_dir) / f"merge-{self.key[:32]}.lock"

    @property
    def log(self) -> Path:
        return Path(self.tmp_dir) / f"merge-{self.key[:32]}.log"


def _claim(lock: Path) -> int | None:
    """An exclusive ``flock`` on ``lock`` with its attempt count raised (the fd, inheritable),
    or None when another process holds it or the attempts are spent."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        tries = int(text) if text.isdigit() else 0
        if tries >= MAX_ATTEMPTS:
            raise BlockingIOError(f"{tries} attempts")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(tries + 1).encode(), 0)
    except BlockingIOError:
        os.close(fd)
        return None
    os.set_inheritable(fd, True)  # held on through the exec, until the entry is in the store
    return fd


def start(job: MergeJob, build: Callable[[Path], None]) -> int | None:
    """Fork the child (module doc): ``build(staging)`` compiles, checks and stores the program
    into a new store at ``staging``; then the fresh interpreter takes it into the real store.
    Returns the child's pid, or None (none started; the pieces serve, nothing else happens)."""
    from aotc._torch.scoped_env import process_scope

    if _running:
        _log.info(f"aotc: {job.label}: a merged program is compiling already; this one at a later start")
        return None
    fd = _claim(job.lock)
    if fd is None:
        _log.info(f"aotc: {job.label}: compiling in another process, or given up after "
                  f"{MAX_ATTEMPTS} attempts (`aotc gc` clears {job.lock.name})")
        return None
    try:
        with process_scope():  # no thread of ours is inside Inductor's state at the fork
            pid = os.fork()
    except BaseException:
        os.close(fd)
        raise
    if pid == 0:
        _child(job, build)  # never returns
    os.close(fd)  # the child holds the lock (the same open file) until it is done
    reaper = threading.Thread(target=_reap, args=(pid,), name=f"aotc-merge-{pid}", daemon=True)
    _running[pid] = reaper
    reaper.start()
    _log.info(f"aotc: {job.label}: compiling in the background (pid {pid}; log {job.log})")
    return pid


def _child(job: MergeJob, build: Callable[[Path], None]) -> None:
    """The forked child: compile into staging, then ``exec`` the ingest (module doc)."""
    code = 1
    try:
        _detach(job.log)
        from aotc._torch import forked
        from aotc.backend.given_up import reason_class

        staging = Path(job.tmp_dir) / f"merge-{job.key[:32]}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)  # a killed child's, whose pid this one reuses
        staging.mkdir(parents=True)
        outcome = {**asdict(job), "ok": False, "reason": "", "remember": False, "reason_class": None}
        try:
            forked.after_fork_in_child()
            t = time.perf_counter()
            build(staging / "store")
            outcome.update(ok=True, seconds=round(time.perf_counter() - t, 1))
        except BaseException as e:  # noqa: BLE001 - said and recorded by the ingest
            cls = reason_class(e)
            outcome.update(reason=one_line(e), remember=cls is not None, reason_class=cls)
        (staging / "outcome.json").write_text(json.dumps(outcome))  # (stderr is line-buffered)
        env = dict(os.environ)  # where this aotc is imported from, first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                          env.get("PYTHONPATH", "")]))
        os.execve(sys.executable, [sys.executable, "-m", "aotc.backend.merge_child", str(staging)], env)
    except BaseException as e:  # noqa: BLE001 - the exec failed: say so and leave
        try:
            _log.warning(f"aotc: warning: {job.label}: no merged program ({one_line(e)})")
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def _detach(log: Path) -> None:
    """stdin/stdout to /dev/null, stderr to ``log``; default signal handlers; the alarm; nice."""
    null = os.open(os.devnull, os.O_RDWR)
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(err, 2)
    os.close(null)
    os.close(err)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)  # not the server's handlers
    signal.alarm(TIME_LIMIT)
    os.nice(10)


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


def ingest(staging: Path, context: Any) -> int:
    """The fresh interpreter's half: take the staged entry into the real store (signed with the
    ``context``'s key, pushed to its remote) or record why there is none; remove ``staging``.
    The exit code (0: stored)."""
    from aotc.cache import Store, failures

    out = json.loads((staging / "outcome.json").read_text())
    try:
        tiered = context.open_tiered(create=True)
        if not out["ok"]:
            if out["remember"]:
                failures.remember(tiered.local, out["key"], out["name"], out["version"], out["reason"],
                                  out.get("reason_class") or failures.UNKNOWN)
            _log.warning(f"aotc: warning: {out['label']}: no merged program ({out['reason']}); the "
                         "pieces serve it")
            return 1
        staged = Store(staging / "store", create=False)
        entry = staged.get(out["key"], record=False)
        blobs = {role: staged.read_blob(entry, role) for role in entry.blobs}
        tiered.publish(entry.key, entry.name, blobs, dict(entry.factors), dict(entry.metadata))
        staged.close()
        _log.info(f"aotc: {out['label']}: compiled, checked and stored in {out['seconds']}s")
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``python -m aotc.backend.merge_child STAGING``: the exec'd ingest, an entry point (its
    context: the environment the child was forked with, the store and remote it names)."""
    from aotc.context import Context
    from aotc.log import configure

    staging = Path(argv[0])
    out = json.loads((staging / "outcome.json").read_text())
    context = Context.from_env(store=out["store_root"], remote=out["remote_url"])
    configure(context.settings.log or "info")
    return ingest(staging, context)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
