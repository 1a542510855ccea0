"""Compile (unique piece, shape) tasks, in this process or spread over worker processes (``-j N``).

Each finished task is a directory ``<work>/<uid>-<size>/`` (``done.json`` + artifact, fast-path
record and kernels), built under a private ``.partial`` name and renamed into place whole, so a
compile killed at any point leaves only complete results — which the next compile of the same key
reuses instead of compiling again (``work`` is the store's per-key work directory). Concurrent
compiles of one key take a task's lock (``flock``, released by the kernel if its holder dies)
before building it, so each task is built once and the others reuse it.

A worker cannot be handed a piece (its graph carries fake tensors with symbolic sizes, which do
not cross processes), so each worker rebuilds the model and re-traces it — deterministic, a few
seconds, started as soon as the compile knows it will compile, so it runs beside the parent's own
trace — then reads its share on stdin, compiles it and reports each artifact as one JSON line on
stdout. The parent compiles a share itself meanwhile. Ids must agree: both sides use
``aotc.compile.pieces``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from aotc._torch import inductor_compile, isa_probes
from aotc.counters import COUNTERS
from aotc.errors import CompileError
from aotc.manifest import Manifest, parse_manifest
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
                  shared: dict[Task, str] | None = None,
                  started: list[Worker] | None = None) -> dict[Task, inductor_compile.CompiledPiece]:
    """Compile every task; with ``jobs`` > 1, ``jobs - 1`` workers take a share each (workers
    re-trace the manifest's model: without a manifest — a graph the backend was handed — every
    task compiles here). ``options``: Inductor patches (default: the manifest's). ``shared``: the
    tasks seeded from other stored entries (``aotc.compile.reuse``), for the progress line.
    ``started``: workers :func:`start_workers` started earlier (the ones not needed are stopped)."""
    options = dict(manifest.inductor) if manifest is not None else dict(options or {})
    if manifest is None:
        jobs = 1
    results: dict[Task, inductor_compile.CompiledPiece] = {}
    lock = threading.Lock()
    total = len(tasks)

    def done(task: Task, c: inductor_compile.CompiledPiece) -> None:
        with lock:
            results[task] = c
            progress.step(len(results), total, _label(*task) + (" (resumed)" if c.reused else ""))

    # finished by an earlier, interrupted compile of this key: not compiled again
    reused = {t: c for t in tasks if (c := _reuse(work, *t, repair=False)) is not None}
    todo = [t for t in tasks if t not in reused]
    # a worker re-traces the model first (a few seconds of a core): worth it for 2 tasks or more
    jobs = max(1, min(jobs, len(todo) // 2))
    shares = [todo[i::jobs] for i in range(jobs)]
    shared = shared or {}
    resumed = len(set(reused) - set(shared))
    progress.step(0, total, "compiling" + (f" in {jobs} processes" if jobs > 1 else "")
                  + (f", {len(shared)} taken from stored entries" if shared else "")
                  + (f", {resumed} reused from {resumed_from(work)}" if resumed else ""))
    for task, c in reused.items():
        done(task, c)
    started = list(started or [])
    for w in started[jobs - 1:]:
        w.kill()
    workers = started[:jobs - 1]
    workers += [Worker(manifest) for _ in range(jobs - 1 - len(workers))]  # type: ignore[arg-type]
    try:
        for w, share in zip(workers, shares[1:]):
            w.start(share, work, done)
        compile_here(first_of, shares[0], work, options, done)
        for w in workers:
            w.wait()
    finally:
        for w in workers:
            w.kill()
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


def compile_here(first_of: dict[str, Piece], tasks: list[Task], work: Path, options: dict[str, Any],
                 done: Any) -> None:
    """Compile ``tasks`` in this process, one after another, each into ``work`` (or taken from a
    finished result there); ``done(task, compiled)`` after each."""
    for uid, size in tasks:
        done((uid, size), _compile_into(work, uid, first_of[uid], size, options))


class Worker:
    """One ``python -m aotc.compile.workers`` process and the thread reading its results. It
    starts re-tracing the manifest's model at once — beside the parent's own trace — and is
    handed its share (:meth:`start`) once the parent knows the tasks."""

    def __init__(self, manifest: Manifest) -> None:
        self.share: list[Task] = []
        self.done: Any = None
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - its stderr, for errors
        self.proc = subprocess.Popen([sys.executable, "-m", "aotc.compile.workers"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        spec = {"manifest": manifest.to_dict(), "file": str(manifest.path or "<manifest>"),
                "base_dir": str(manifest.base_dir or Path.cwd()), "parent": os.getpid()}
        self._send(spec, last=False)
        self.received = 0
        self.thread: threading.Thread | None = None

    def _send(self, message: dict[str, Any], last: bool) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            if last:
                self.proc.stdin.close()
        except OSError:  # it died (its log says why): wait() reports it
            pass

    def start(self, share: list[Task], work: Path, done: Any) -> None:
        """Hand the worker its share of tasks, to compile into ``work``; ``done`` per result."""
        self.share, self.done = share, done
        self._send({"tasks": [[u, s] for u, s in share], "work": str(work),
                    "isa_probes": str(isa_probes.kept_isa_probes() or "")}, last=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                task, c = _from_json(line)
                if not c.reused:
                    COUNTERS.compiles += 1  # an Inductor compile ran, in the worker
                self.received += 1
                self.done(task, c)

    def wait(self) -> None:
        """Wait for the share; raise :class:`CompileError` if the worker did not deliver it."""
        if self.thread is None:
            return
        rc = self.proc.wait()
        self.thread.join()
        if rc != 0 or self.received != len(self.share):
            self.log.seek(0)
            tail = " | ".join(self.log.read().strip().splitlines()[-3:])
            raise CompileError(f"compile worker exited with {rc} after {self.received}/"
                               f"{len(self.share)} pieces: {tail[-600:]}")

    def kill(self) -> None:
        """Stop the worker now (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def start_workers(manifest: Manifest, jobs: int) -> list[Worker]:
    """The ``jobs - 1`` workers of a ``-j jobs`` compile, started now so that they re-trace while
    this process traces; only for a manifest with compile sizes (a dynamic-only compile has too
    few tasks to give a worker two: :func:`compile_tasks` decides later)."""
    if jobs <= 1 or not manifest.compile_sizes:
        return []
    return [Worker(manifest) for _ in range(jobs - 1)]


def _die_with_parent(parent: int) -> None:
    """A worker must not outlive a killed compile (Linux: the kernel sends it SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: a killed parent's worker finishes its share, writes nothing visible
    if os.getppid() != parent:  # the parent died before the call above (reparented)
        os._exit(1)


def _worker_main() -> None:
    """A worker: the manifest on stdin's first line, its share on the second (none: exit)."""
    from aotc.compile.pieces import trace_and_split

    spec = json.loads(sys.stdin.readline())
    _die_with_parent(int(spec.get("parent", os.getppid())))
    manifest = parse_manifest(spec["manifest"], spec["file"], Path(spec["base_dir"]))
    traced = trace_and_split(manifest)
    line = sys.stdin.readline()
    if not line:  # the parent needs no share after all
        return
    job = json.loads(line)
    work = Path(job["work"])
    if job.get("isa_probes"):
        isa_probes.keep_isa_probes(Path(job["isa_probes"]))
    for uid, size in job["tasks"]:
        piece = traced.first_of.get(uid)
        if piece is None:
            raise SystemExit(f"worker traced no piece {uid} (ids {sorted(traced.first_of)}): "
                             "the model does not trace deterministically")
        c = _compile_into(work, uid, piece, size, dict(manifest.inductor))
        print(_to_json(uid, c), flush=True)


if __name__ == "__main__":
    _worker_main()
