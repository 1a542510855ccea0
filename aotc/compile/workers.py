"""Schedule (unique piece, shape) tasks, in this process or spread over worker processes
(``-j N``); the compiling itself is the compiler seam's (:mod:`aotc._torch.compiler`).

Each finished task is a directory ``<work>/<uid>-<size>/`` (its record, written and read by
:mod:`aotc._torch.task_result`, + artifact, fast-path record and kernels), built under a private
``.partial`` name and renamed into place whole, so a compile killed at any point leaves only
complete results — which the next compile of the same key reuses instead of compiling again
(``work`` is the store's per-key work directory). Concurrent compiles of one key take a task's
lock (``flock``, released by the kernel if its holder dies) before building it, so each task is
built once and the others reuse it.

With ``-j N``, N - 1 workers forked after the split (``aotc.compile.forked_workers``) take
tasks from one queue beside this process, which then compiles whatever a worker that died did
not report. Within a process, ``_HOLD`` tasks in a row are started and then finished together
(their C++ kernels built by one compiler run), each then committed under its lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aotc._torch import forked, kernel_batch
from aotc._torch.compiler import PieceCompiler, as_fresh
from aotc._torch.task_result import CompiledPiece, read_result, save_result
from aotc.compile.forked_workers import ForkedWorker, TaskQueue
from aotc.compile.split import Piece
from aotc.errors import CompileError
from aotc.progress import Progress

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


def _reuse(work: Path, uid: str, size: int | None, repair: bool = True) -> CompiledPiece | None:
    """The finished result of a task in ``work``, if a previous or concurrent compile left one
    whose files are all there at their recorded sizes. ``repair`` (only under the task's lock)
    removes a result that fails the check, so it is built again."""
    out = _out_dir(work, uid, size)
    try:
        return read_result(out)
    except FileNotFoundError:
        if repair and out.exists():  # incomplete: not ours to trust
            shutil.rmtree(out, ignore_errors=True)
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged: build it again
        if repair:
            shutil.rmtree(out, ignore_errors=True)
        return None


def discard(work: Path, tasks: list[Task]) -> None:
    """Remove the finished results of ``tasks`` (after they failed a check: never reuse them)."""
    for uid, size in tasks:
        claim = _Claim(work, uid, size)
        try:
            shutil.rmtree(claim.out, ignore_errors=True)
        finally:
            claim.release()


class _Claim:
    """One task this process holds: the exclusive lock of its result directory (the kernel drops
    it if the holder dies: a concurrent compile of the same key waits for the task, then reuses
    it), a private ``.partial`` dir to build in; :meth:`commit` renames the result into place."""

    def __init__(self, work: Path, uid: str, size: int | None) -> None:
        self.work, self.uid, self.size = work, uid, size
        self.out = _out_dir(work, uid, size)
        self.lock = os.open(work / f".{self.out.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.partial: Path | None = None

    def scratch(self) -> Path:
        """The private dir the task is built in."""
        self.partial = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".partial",
                                             dir=self.work))
        return self.partial

    def commit(self, c: CompiledPiece) -> CompiledPiece:
        """Make the compiled result in the scratch dir the task's finished result: on disk
        (:func:`~aotc._torch.task_result.save_result`) before the rename makes it visible (a
        concurrent compile that finished it first wins: same key, same result)."""
        if self.partial is None:
            raise CompileError(f"piece {self.uid} committed before it was built (an aotc bug)")
        save_result(c, self.partial / "result", self.uid)
        try:
            os.rename(self.partial / "result", self.out)
        except OSError:
            pass
        found = _reuse(self.work, self.uid, self.size)
        if found is None:
            raise CompileError(f"compiled piece {self.uid} vanished from {self.work} (removed by "
                               "gc?); compile again")
        return as_fresh(found, c)

    def release(self) -> None:
        """Drop the scratch dir and the lock (idempotent)."""
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
            self.partial = None
        if self.lock >= 0:
            os.close(self.lock)
            self.lock = -1


def _label(uid: str, size: int | None) -> str:
    return f"piece {uid[:8]} {'dynamic' if size is None else f'{size} tokens'}"


def compile_tasks(first_of: dict[str, Piece], tasks: list[Task], work: Path, progress: Progress,
                  options: dict[str, Any], jobs: int = 1, fork: bool = False,
                  shared: dict[Task, str] | None = None) -> dict[Task, CompiledPiece]:
    """Compile every task with Inductor patches ``options``; with ``fork`` and ``jobs`` > 1, in
    that many processes (``jobs - 1`` forked workers, see the module doc; never once CUDA is
    initialized — a graph the backend was handed compiles inside a server's process, which is
    not forked: its caller says ``fork=False``). ``shared``: the tasks seeded from other stored
    entries (``aotc.compile.reuse``), for the progress line."""
    options = dict(options)
    if not fork or len(tasks) > TaskQueue.LIMIT or not forked.fork_is_safe():
        jobs = 1
    results: dict[Task, CompiledPiece] = {}
    lock = threading.Lock()
    total = len(tasks)

    def done(task: Task, c: CompiledPiece, by: str = "") -> None:
        with lock:
            results[task] = c
            progress.step(len(results), total, _label(*task) + (" (resumed)" if c.resumed else "")
                          + (" (shared)" if c.shared else "")
                          + (f" ({by})" if by else ""))

    # finished in the work directory: by an earlier, interrupted compile of this key (resumed) or
    # seeded there from another stored entry (shared); not compiled again
    shared = shared or {}
    found = {t: c if t not in shared else replace(c, resumed=False, shared=True)
             for t in tasks if (c := _reuse(work, *t, repair=False)) is not None}
    todo = [t for t in tasks if t not in found]
    jobs = max(1, min(jobs, len(todo)))
    resumed = sum(c.resumed for c in found.values())
    progress.step(0, total, "compiling" + (f" in {jobs} processes" if jobs > 1 else "")
                  + (f", {len(shared)} taken from stored entries" if shared else "")
                  + (f", {resumed} resumed from {resumed_from(work)}" if resumed else ""))
    for task, c in found.items():
        done(task, c)
    with kernel_batch.sharing_cores(jobs):  # the processes below build kernels at once
        queue = TaskQueue(todo) if jobs > 1 else None
        workers: list[ForkedWorker] = []
        try:
            if queue is not None:
                def here(some: Iterable[Task], report: Any) -> None:
                    compile_here(first_of, some, work, options, report)

                workers = [ForkedWorker(here, queue, done, f"worker {i}") for i in range(1, jobs)]
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
        if c.compiled_here:
            for k, v in c.phases.items():
                out[k] = round(out.get(k, 0.0) + v, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kernel_builds(compiled: Any) -> dict[str, int]:
    """Kernel libraries the pieces actually compiled built, and took from the job's pool."""
    out = {"built": 0, "pooled": 0}
    for c in compiled:
        if c.compiled_here:
            for k in out:
                out[k] += int(c.kernels.get(k, 0))
    return out


def artifact_files(artifacts: Any, compiled: dict[Task, CompiledPiece]) -> dict[str, Path]:
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


_HOLD = 3  # tasks in a row whose kernels one compiler run builds (aotc._torch.compiler)


def compile_here(first_of: dict[str, Piece], tasks: Iterable[Task], work: Path,
                 options: dict[str, Any], done: Any, hold: int = _HOLD) -> None:
    """Compile ``tasks`` (a list, or a :class:`~aotc.compile.forked_workers.TaskQueue` to take
    them from) in this process, each into ``work`` or taken from a finished result there;
    ``done(task, compiled)`` after each. Up to ``hold`` tasks in a row are finished together
    (:class:`~aotc._torch.compiler.PieceCompiler`); this only claims, schedules and commits."""
    compiler = PieceCompiler(options, work / _POOL)
    claims: dict[Task, _Claim] = {}

    def finish_held() -> None:
        for task, c in compiler.finish():
            claim = claims.pop(task)
            try:
                c = claim.commit(c)
            finally:
                claim.release()
            done(task, c)

    try:
        for uid, size in tasks:
            claim = _Claim(work, uid, size)
            try:
                found = _reuse(work, uid, size)
                if found is not None:
                    claim.release()
                    done((uid, size), found)
                    continue
                piece = first_of[uid]
                compiler.start((uid, size), piece.gm, piece.example_inputs, size, claim.scratch(),
                               piece.real_inputs, f"{uid}:{size or 'dynamic'}")
            except BaseException:
                claim.release()
                raise
            claims[(uid, size)] = claim
            if len(compiler) >= hold:
                finish_held()
        finish_held()
    finally:
        compiler.abandon()
        for claim in claims.values():
            claim.release()
