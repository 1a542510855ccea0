"""Compile (unique piece, shape) tasks, in this process or spread over worker processes (``-j N``).

A worker cannot be handed a piece (its graph carries fake tensors with symbolic sizes, which do
not cross processes), so each worker rebuilds the model and re-traces it — deterministic, a few
seconds — then compiles its share and reports each artifact as one JSON line on stdout. The
parent compiles a share itself meanwhile. Ids must agree: both sides use ``aotc.pieces``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from aotc import inductor
from aotc.counters import COUNTERS
from aotc.errors import CompileError
from aotc.manifest import Manifest, parse_manifest
from aotc.progress import Progress
from aotc.split import Piece

Task = tuple[str, "int | None"]


def _out_dir(work: Path, uid: str, size: int | None) -> Path:
    return work / f"{uid}-{size or 'dyn'}"


def _label(uid: str, size: int | None) -> str:
    return f"piece {uid[:8]} {'dynamic' if size is None else f'{size} tokens'}"


def _to_json(uid: str, c: inductor.CompiledPiece) -> str:
    return json.dumps({"uid": uid, "size": c.size, "artifact": str(c.artifact),
                       "kernel_root": str(c.kernel_root), "kernel_files": list(c.kernel_files),
                       "key": c.key, "seconds": c.seconds,
                       "wrapper": None if c.wrapper is None else str(c.wrapper),
                       "wrapper_note": c.wrapper_note})


def _from_json(line: str) -> tuple[Task, inductor.CompiledPiece]:
    d = json.loads(line)
    return (d["uid"], d["size"]), inductor.CompiledPiece(
        Path(d["artifact"]), Path(d["kernel_root"]), tuple(d["kernel_files"]), d["size"], d["key"],
        float(d["seconds"]), None if d.get("wrapper") is None else Path(d["wrapper"]),
        str(d.get("wrapper_note", "")))


def compile_tasks(manifest: Manifest, first_of: dict[str, Piece], tasks: list[Task], work: Path,
                  progress: Progress, jobs: int = 1) -> dict[Task, inductor.CompiledPiece]:
    """Compile every task; with ``jobs`` > 1, ``jobs - 1`` workers take a share each."""
    options = dict(manifest.inductor)
    results: dict[Task, inductor.CompiledPiece] = {}
    lock = threading.Lock()
    total = len(tasks)

    def done(task: Task, c: inductor.CompiledPiece) -> None:
        with lock:
            results[task] = c
            progress.step(len(results), total, _label(*task))

    jobs = max(1, min(jobs, len(tasks)))
    shares = [tasks[i::jobs] for i in range(jobs)]
    workers = [_Worker(manifest, share, work, done) for share in shares[1:]]
    try:
        progress.step(0, total, "compiling" + (f" in {jobs} processes" if jobs > 1 else ""))
        for uid, size in shares[0]:
            piece = first_of[uid]
            c = inductor.compile_piece(piece.gm, list(piece.example_inputs), size,
                                       _out_dir(work, uid, size), options)
            done((uid, size), c)
        for w in workers:
            w.wait()
    finally:
        for w in workers:
            w.kill()
    return results


class _Worker:
    """One ``python -m aotc.parallel SPEC`` process and the thread reading its results."""

    def __init__(self, manifest: Manifest, share: list[Task], work: Path, done: Any) -> None:
        self.share, self.done = share, done
        spec = {"manifest": manifest.to_dict(), "file": str(manifest.path or "<manifest>"),
                "base_dir": str(manifest.base_dir or Path.cwd()),
                "tasks": [[u, s] for u, s in share], "work": str(work)}
        fd, self.spec_path = tempfile.mkstemp(prefix="aotc-worker-", suffix=".json", dir=work)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        self.log = open(Path(self.spec_path).with_suffix(".log"), "w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "aotc.parallel", self.spec_path],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.received = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                task, c = _from_json(line)
                COUNTERS["compiles"] += 1  # an Inductor compile ran, in the worker
                self.received += 1
                self.done(task, c)

    def wait(self) -> None:
        rc = self.proc.wait()
        self.thread.join()
        if rc != 0 or self.received != len(self.share):
            self.log.seek(0)
            tail = " | ".join(self.log.read().strip().splitlines()[-3:])
            raise CompileError(f"compile worker exited with {rc} after {self.received}/"
                               f"{len(self.share)} pieces: {tail[-600:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _worker_main(spec_path: str) -> None:
    from aotc.pieces import trace_and_split

    spec = json.loads(Path(spec_path).read_text())
    manifest = parse_manifest(spec["manifest"], spec["file"], Path(spec["base_dir"]))
    traced = trace_and_split(manifest)
    work = Path(spec["work"])
    for uid, size in spec["tasks"]:
        piece = traced.first_of.get(uid)
        if piece is None:
            raise SystemExit(f"worker traced no piece {uid} (ids {sorted(traced.first_of)}): "
                             "the model does not trace deterministically")
        c = inductor.compile_piece(piece.gm, list(piece.example_inputs), size,
                                   _out_dir(work, uid, size), dict(manifest.inductor))
        print(_to_json(uid, c), flush=True)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
