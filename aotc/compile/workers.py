"""Compile (unique piece, shape) tasks, in this process or spread over worker processes (``-j N``).

Each finished task is a directory ``<work>/<uid>-<size>/`` (``done.json`` + artifact, fast-path
record and kernels), built under a private ``.partial`` name and renamed into place whole, so a
compile killed at any point leaves only complete results — which the next compile of the same key
reuses instead of compiling again (``work`` is the store's per-key work directory). Concurrent
compiles of one key take a task's lock (``flock``, released by the kernel if its holder dies)
before building it, so each task is built once and the others reuse it.

A worker is forked from the compiling process once the pieces are split (a piece's graph
carries fake tensors with symbolic sizes, which do not cross processes; a forked child has them
in memory, so nothing is re-traced or sent). The tasks wait in one queue — a pipe holding their
indices, written whole before the fork; a read of one index is atomic, so every process takes
the next free task when it is free (no fixed shares: pieces differ in cost). Each worker reports
its results as JSON lines on its own pipe; the parent compiles from the queue meanwhile, then
compiles whatever a worker that died did not report. The child first resets what a fork leaves
broken (``aotc._torch.forked``: OpenMP's thread team, Inductor's build pool) and always leaves
with ``os._exit`` (the parent's cleanup is the parent's).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import sys
import tempfile
import threading
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from aotc._torch import forked, inductor_compile
from aotc.counters import COUNTERS
from aotc.errors import CompileError
from aotc.manifest import Manifest
from aotc.progress import Progress
from aotc.compile.split import Piece

Task = tuple[str, "int | None"]


def _out_dir(work: Path, uid: str, size: int | None) -> Path:
    return work / f"{uid}-{size or 'dyn'}"


_CHECK_FAILED = "check-failed.txt"
_POOL = "kernel-pool"  # the kernel libraries the key's tasks built (aotc._torch.kernel_pool)


def note_check_failed(work: Path, why: str) -> None:
    """Remember in the key's work directory that a compile finished its pieces but failed the
    numeric check, so the next compile of the key says it reuses those (not "interrupted")."""
    try:
        (work / _CHECK_FAILED).write_text(why[:500])
    except OSError:
        pass


def resumed_from(work: Path) -> str:
    """Why finished pieces are in ``work``: an earlier compile's failed check, or a crash."""
    return ("an earlier compile of this key that failed its numeric check"
            if (work / _CHECK_FAILED).is_file() else "an interrupted compile")


def _reuse(work: Path, uid: str, size: int | None, repair: bool = True) -> inductor_compile.CompiledPiece | None:
    """The finished result of a task in ``work``, if a previous or concurrent compile left one
    whose files are all there at their recorded sizes. ``repair`` (only under the task's lock)
    removes a result that fails the check, so it is built again."""
    out = _out_dir(work, uid, size)
    try:
        d = json.loads((out / "done.json").read_text())
        c = inductor_compile.CompiledPiece(
            out / d["artifact"], out / "kernels", tuple(d["kernel_files"]), d["size"], d["key"],
            float(d["seconds"]), None if d["wrapper"] is None else out / d["wrapper"],
            str(d["wrapper_note"]), reused=True, phases=dict(d.get("phases") or {}),
            kernels=dict(d.get("kernels") or {}))
        for rel, n in d["sizes"].items():  # a file cut short (power loss, disk full): rebuild
            if (out / rel).stat().st_size != n:
                raise ValueError(f"{rel} is not {n} bytes")
        return c
    except FileNotFoundError:
        if repair and out.exists():  # incomplete: not ours to trust
            shutil.rmtree(out, ignore_errors=True)
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged: build it again
        if repair:
            shutil.rmtree(out, ignore_errors=True)
        return None


@contextmanager
def _task_lock(work: Path, out: Path) -> Iterator[None]:
    """Hold the exclusive lock of one task's result directory ``out`` (the kernel drops it if
    the holder dies): a concurrent compile of the same key waits for the task, then reuses it."""
    lock = os.open(work / f".{out.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def discard(work: Path, tasks: list[Task]) -> None:
    """Remove the finished results of ``tasks`` (after they failed a check: never reuse them)."""
    for uid, size in tasks:
        out = _out_dir(work, uid, size)
        with _task_lock(work, out):
            shutil.rmtree(out, ignore_errors=True)


def _compile_into(work: Path, uid: str, piece: Piece, size: int | None,
                  options: dict[str, Any]) -> inductor_compile.CompiledPiece:
    """Compile one task into a private directory, then rename it into place (or take the result
    a concurrent compile put there first)."""
    out = _out_dir(work, uid, size)
    with _task_lock(work, out):
        found = _reuse(work, uid, size)
        if found is not None:
            return found
        return _build(work, out, uid, piece, size, options)


def _build(work: Path, out: Path, uid: str, piece: Piece, size: int | None,
           options: dict[str, Any]) -> inductor_compile.CompiledPiece:
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=work))
    try:
        c = inductor_compile.compile_piece(piece.gm, list(piece.example_inputs), size, partial / "result",
                                           options, tmp_root=partial, real_inputs=piece.real_inputs,
                                           key=f"{uid}:{size or 'dynamic'}", pool=work / _POOL)
        result = partial / "result"
        files = [c.artifact, *(c.kernel_root / rel for rel in c.kernel_files)]
        if c.wrapper is not None:
            files.append(c.wrapper)
        sizes = {}
        for f in files:  # on disk before the rename makes them visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            sizes[f.relative_to(result).as_posix()] = f.stat().st_size
        done = {"uid": uid, "size": size, "artifact": c.artifact.name,
                "kernel_files": list(c.kernel_files), "key": c.key, "seconds": c.seconds,
                "wrapper": None if c.wrapper is None else c.wrapper.name,
                "wrapper_note": c.wrapper_note, "sizes": sizes, "phases": c.phases,
                "kernels": c.kernels}
        (result / "done.json").write_text(json.dumps(done))
        try:
            os.rename(result, out)
        except OSError:  # a concurrent compile finished it first: same key, same result
            pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    found = _reuse(work, uid, size)
    if found is None:
        raise CompileError(f"compiled piece {uid} vanished from {work} (removed by gc?); compile again")
    return replace(found, reused=False, seconds=c.seconds, phases=c.phases, kernels=c.kernels)


def _label(uid: str, size: int | None) -> str:
    return f"piece {uid[:8]} {'dynamic' if size is None else f'{size} tokens'}"


def _to_json(uid: str, c: inductor_compile.CompiledPiece) -> str:
    return json.dumps({"uid": uid, "size": c.size, "artifact": str(c.artifact),
                       "kernel_root": str(c.kernel_root), "kernel_files": list(c.kernel_files),
                       "key": c.key, "seconds": c.seconds,
                       "wrapper": None if c.wrapper is None else str(c.wrapper),
                       "wrapper_note": c.wrapper_note, "reused": c.reused, "phases": c.phases,
                       "kernels": c.kernels})


def _from_json(line: str) -> tuple[Task, inductor_compile.CompiledPiece]:
    d = json.loads(line)
    return (d["uid"], d["size"]), inductor_compile.CompiledPiece(
        Path(d["artifact"]), Path(d["kernel_root"]), tuple(d["kernel_files"]), d["size"], d["key"],
        float(d["seconds"]), None if d.get("wrapper") is None else Path(d["wrapper"]),
        str(d.get("wrapper_note", "")), bool(d.get("reused", False)), dict(d.get("phases") or {}),
        dict(d.get("kernels") or {}))


def compile_tasks(manifest: Manifest | None, first_of: dict[str, Piece], tasks: list[Task], work: Path,
                  progress: Progress, jobs: int = 1, options: dict[str, Any] | None = None,
                  shared: dict[Task, str] | None = None) -> dict[Task, inductor_compile.CompiledPiece]:
    """Compile every task; with ``jobs`` > 1, in that many processes (``jobs - 1`` forked
    workers, see the module doc; only with a manifest — a graph the backend was handed compiles
    inside a server's process, which is not forked). ``options``: Inductor patches (default:
    the manifest's). ``shared``: the tasks seeded from other stored entries
    (``aotc.compile.reuse``), for the progress line."""
    options = dict(manifest.inductor) if manifest is not None else dict(options or {})
    if manifest is None or not hasattr(os, "fork") or len(tasks) > TaskQueue.LIMIT:
        jobs = 1
    results: dict[Task, inductor_compile.CompiledPiece] = {}
    lock = threading.Lock()
    total = len(tasks)

    def done(task: Task, c: inductor_compile.CompiledPiece, by: str = "") -> None:
        with lock:
            results[task] = c
            progress.step(len(results), total, _label(*task) + (" (resumed)" if c.reused else "")
                          + (f" ({by})" if by else ""))

    # finished by an earlier, interrupted compile of this key: not compiled again
    reused = {t: c for t in tasks if (c := _reuse(work, *t, repair=False)) is not None}
    todo = [t for t in tasks if t not in reused]
    jobs = max(1, min(jobs, len(todo)))
    shared = shared or {}
    resumed = len(set(reused) - set(shared))
    progress.step(0, total, "compiling" + (f" in {jobs} processes" if jobs > 1 else "")
                  + (f", {len(shared)} taken from stored entries" if shared else "")
                  + (f", {resumed} reused from {resumed_from(work)}" if resumed else ""))
    for task, c in reused.items():
        done(task, c)
    queue = TaskQueue(todo) if jobs > 1 else None
    workers: list[ForkedWorker] = []
    try:
        if queue is not None:
            workers = [ForkedWorker(first_of, queue, work, options, done, f"worker {i}")
                   for i in range(1, jobs)]
        compile_here(first_of, queue if queue is not None else todo, work, options, done)
        for w in workers:
            w.wait()
            if w.error():
                progress.note(f"compile {w.name} failed after {w.received} piece(s); this process "
                              f"compiles what it left: {w.error()}")
        # what a worker that died took and did not report (its error, if genuine, comes again)
        compile_here(first_of, [t for t in todo if t not in results], work, options, done)
    finally:
        for w in workers:
            w.kill()
        if queue is not None:
            queue.close()
    return results


def profile(compiled: Any) -> dict[str, float]:
    """Seconds by step (``CompiledPiece.phases``) summed over the pieces actually compiled."""
    out: dict[str, float] = {}
    for c in compiled:
        if not c.reused:
            for k, v in c.phases.items():
                out[k] = round(out.get(k, 0.0) + v, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kernel_builds(compiled: Any) -> dict[str, int]:
    """Kernel libraries the pieces actually compiled built, and took from the job's pool."""
    out = {"built": 0, "pooled": 0}
    for c in compiled:
        if not c.reused:
            for k in out:
                out[k] += int(c.kernels.get(k, 0))
    return out


def artifact_files(artifacts: Any, compiled: dict[Task, inductor_compile.CompiledPiece]) -> dict[str, Path]:
    """Blob role -> file of every artifact record (``ArtifactRecord``) and its fast-path record."""
    files: dict[str, Path] = {}
    for a in artifacts:
        c = compiled[(a.uid, a.size)]
        files[a.role] = c.artifact
        if a.wrapper_role and c.wrapper is not None:
            files[a.wrapper_role] = c.wrapper
    return files


def merge_kernels(compiled: Any, root: Path) -> set[str]:
    """Gather the kernel files of every compiled piece (``CompiledPiece`` values) under one root;
    Inductor's paths are content-addressed, so one relative path always holds the same bytes.
    Returns the relative paths."""
    seen: set[str] = set()
    for c in compiled:
        for rel in c.kernel_files:
            if rel not in seen:
                dst = root / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(c.kernel_root / rel, dst)
                seen.add(rel)
    return seen


def compile_here(first_of: dict[str, Piece], tasks: Any, work: Path, options: dict[str, Any],
                 done: Any) -> None:
    """Compile ``tasks`` (a list, or a :class:`TaskQueue` to take them from) in this process,
    one after another, each into ``work`` (or taken from a finished result there);
    ``done(task, compiled)`` after each."""
    for uid, size in tasks:
        done((uid, size), _compile_into(work, uid, first_of[uid], size, options))


class TaskQueue:
    """The tasks of one compile, shared by its processes: their indices in a pipe, written whole
    (and its write end closed) before any worker is forked. Iterating takes the next task no
    process has taken yet; an empty pipe reads as the end."""

    _INDEX = struct.Struct("<I")
    LIMIT = 4000  # indices that fit a pipe's buffer everywhere (16 KiB), so the write never blocks

    def __init__(self, tasks: list[Task]) -> None:
        if len(tasks) > self.LIMIT:
            raise CompileError(f"{len(tasks)} tasks for one queue; at most {self.LIMIT}")
        self.tasks = list(tasks)
        self.read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, b"".join(self._INDEX.pack(i) for i in range(len(self.tasks))))
        finally:
            os.close(write_fd)

    def __iter__(self) -> Iterator[Task]:
        while True:
            raw = os.read(self.read_fd, self._INDEX.size)  # one index, whole (pipe reads are)
            if len(raw) < self._INDEX.size:
                return
            yield self.tasks[self._INDEX.unpack(raw)[0]]

    def close(self) -> None:
        """Release the pipe (idempotent)."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


class ForkedWorker:
    """A child of this process, forked now, that compiles tasks from ``queue`` until it is empty
    and reports each result to ``done`` (from a thread reading its pipe); see the module doc."""

    def __init__(self, first_of: dict[str, Piece], queue: TaskQueue, work: Path,
                 options: dict[str, Any], done: Any, name: str) -> None:
        self.done, self.name = done, name
        self.received = 0
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the child's stdout and stderr
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        with warnings.catch_warnings():  # 3.12 warns of fork with threads: see aotc._torch.forked
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read_fd)
            _child_main(first_of, queue, work, options, write_fd, self.log.fileno(), parent)
        os.close(write_fd)
        self.pid = pid
        self.status: int | None = None
        self.results = os.fdopen(read_fd, "r")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.results:
            if line.startswith("{"):
                task, c = _from_json(line)
                if not c.reused:
                    COUNTERS.compiles += 1  # an Inductor compile ran, in the worker
                self.received += 1
                self.done(task, c, self.name)

    def wait(self) -> None:
        """Wait for the worker to finish the queue (a worker that failed leaves its unreported
        tasks to the parent; its log is in :meth:`error`)."""
        if self.status is None:
            self.status = os.waitpid(self.pid, 0)[1]
        self.thread.join()

    def error(self) -> str:
        """Why the worker failed: its exit and the last lines it wrote ("" when it exited
        cleanly, or has not exited)."""
        if self.status in (None, 0):
            return ""
        how = (f"killed by signal {os.WTERMSIG(self.status)}" if os.WIFSIGNALED(self.status)
               else f"exit status {os.waitstatus_to_exitcode(self.status)}")
        self.log.seek(0)
        tail = " | ".join(self.log.read().strip().splitlines()[-3:])[-600:]
        return how + (f": {tail}" if tail else "")

    def kill(self) -> None:
        """Stop the worker now (idempotent)."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.status = os.waitpid(self.pid, 0)[1]
        self.thread.join(timeout=5)
        for f in (self.results, self.log):
            try:
                f.close()
            except OSError:
                pass


def _child_main(first_of: dict[str, Piece], queue: TaskQueue, work: Path, options: dict[str, Any],
                out_fd: int, log_fd: int, parent: int) -> None:
    """A forked worker's whole life: take tasks until the queue is empty, report each on
    ``out_fd``, leave with ``os._exit`` (0 when every taken task was reported)."""
    code = 1
    try:
        os.dup2(log_fd, 1)  # the parent's stdout may be a --json answer
        os.dup2(log_fd, 2)
        _die_with_parent(parent)
        forked.after_fork_in_child()
        with os.fdopen(out_fd, "w") as out:
            for uid, size in queue:
                c = _compile_into(work, uid, first_of[uid], size, options)
                out.write(_to_json(uid, c) + "\n")
                out.flush()
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the log; the parent compiles the rest
        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def _die_with_parent(parent: int) -> None:
    """A worker must not outlive a killed compile (Linux: the kernel sends it SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: a killed parent's worker finishes its task, writes nothing visible
    if os.getppid() != parent:  # the parent died before the call above (reparented)
        os._exit(1)
