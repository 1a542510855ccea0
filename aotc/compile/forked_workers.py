"""``-j`` workers: children forked from the compiling process once the pieces are split.

A piece's graph carries fake tensors with symbolic sizes, which do not cross processes; a forked
child has them in memory, so nothing is re-traced or sent. The tasks wait in one queue — a pipe
holding their indices, written whole before the fork; a read of one index is atomic, so every
process takes the next free task when it is free (no fixed shares: pieces differ in cost). Each
worker reports its results as JSON lines on its own pipe. The child first resets what a fork
leaves broken (``aotc._torch.forked``: OpenMP's thread team, Inductor's build pool) and always
leaves with ``os._exit`` (the parent's cleanup is the parent's).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from aotc._torch import forked
from aotc._torch.task_result import CompiledPiece
from aotc.counters import COUNTERS
from aotc.errors import CompileError

Task = tuple[str, "int | None"]
# compiles the tasks it is given in this process, calling done(task, compiled) after each
Compile = Callable[[Iterable[Task], Callable[..., None]], None]

__all__ = ["ForkedWorker", "TaskQueue"]


def _to_json(uid: str, c: CompiledPiece) -> str:
    return json.dumps({**c.to_json(), "uid": uid})


def _from_json(line: str) -> tuple[Task, CompiledPiece]:
    d = json.loads(line)
    return (d["uid"], d["size"]), CompiledPiece.from_json(d)


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
    """A child of this process, forked now, that runs ``compile_here`` on the tasks of ``queue``
    until it is empty and reports each result to ``done(task, compiled, name)`` (from a thread
    reading its pipe); see the module doc."""

    def __init__(self, compile_here: Compile, queue: TaskQueue, done: Any, name: str) -> None:
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
            _child_main(compile_here, queue, write_fd, self.log.fileno(), parent)
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
                if c.compiled_here:
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


def _child_main(compile_here: Compile, queue: TaskQueue, out_fd: int, log_fd: int,
                parent: int) -> None:
    """A forked worker's whole life: compile tasks until the queue is empty, report each on
    ``out_fd``, leave with ``os._exit`` (0 when every taken task was reported)."""
    code = 1
    try:
        os.dup2(log_fd, 1)  # the parent's stdout may be a --json answer
        os.dup2(log_fd, 2)
        _die_with_parent(parent)
        forked.after_fork_in_child()
        with os.fdopen(out_fd, "w") as out:
            def report(task: Task, c: CompiledPiece, *_: Any) -> None:
                out.write(_to_json(task[0], c) + "\n")
                out.flush()

            compile_here(queue, report)
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
