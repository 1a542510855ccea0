"""A finished (piece, size) compile task: :class:`CompiledPiece`, its one JSON form
(:meth:`CompiledPiece.to_json` / :meth:`~CompiledPiece.from_json`: a result directory's
``done.json`` and a forked worker's report alike), and the one writer and reader of a result
directory: :func:`save_result` makes it durable (every file, the record and the directory
fsynced before the caller's rename publishes it) on every path — a compile, or a piece taken
from another stored entry; :func:`read_result` checks every file at its recorded size.

Plain Python, no torch: part of the compiler seam (:mod:`aotc._torch.compiler`). Tested with torch
2.11 and 2.13 (it names no torch API).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from aotc.cache.blobio import fsync_dir

__all__ = ["RESULT_FILE", "CompiledPiece", "read_result", "save_result"]

RESULT_FILE = "done.json"


@dataclasses.dataclass(frozen=True)
class CompiledPiece:
    """One compiled artifact of one piece, for one size (``None`` = dynamic).

    ``artifact``: the ``standalone_compile`` binary artifact file; ``kernel_root``: the
    directory the kernel files are relative to; ``kernel_files``: sorted relative paths (POSIX)
    to store with the artifact and restore under one root before it is loaded;
    ``key``: Inductor's cache key of this compile; ``seconds``: wall time of the compile.
    """

    artifact: Path
    kernel_root: Path
    kernel_files: tuple[str, ...]
    size: int | None
    key: str
    seconds: float
    wrapper: Path | None = None  # the fast-path record (aotc._torch.wrapper), when the piece qualifies
    wrapper_note: str = ""  # why it does not
    resumed: bool = False  # found finished in the work directory: an interrupted compile of this key
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds by step (a profile)
    # kernel libraries: "built" by this compile, "pooled" taken from the job's kernel pool
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)
    shared: bool = False  # taken from another stored entry (aotc.compile.reuse), not compiled

    @property
    def compiled_here(self) -> bool:
        """Whether this run compiled it (neither resumed nor shared)."""
        return not (self.resumed or self.shared)

    def to_json(self, base: Path | None = None) -> dict[str, Any]:
        """The record of this result: its files relative to ``base`` (a result directory), or
        absolute when ``base`` is None (a worker's report to its parent)."""
        def where(p: Path) -> str:
            return p.relative_to(base).as_posix() if base is not None else str(p)

        return {"size": self.size, "artifact": where(self.artifact), "kernel_root": where(self.kernel_root),
                "kernel_files": list(self.kernel_files), "key": self.key, "seconds": self.seconds,
                "wrapper": None if self.wrapper is None else where(self.wrapper),
                "wrapper_note": self.wrapper_note, "resumed": self.resumed, "phases": self.phases,
                "kernels": self.kernels, "shared": self.shared}

    @classmethod
    def from_json(cls, d: dict[str, Any], base: Path | None = None) -> CompiledPiece:
        """The result :meth:`to_json` wrote (``base``: the same as there)."""
        def where(p: str) -> Path:
            return base / p if base is not None else Path(p)

        return cls(where(d["artifact"]), where(d.get("kernel_root", "kernels")), tuple(d["kernel_files"]),
                   d["size"], d["key"], float(d["seconds"]),
                   None if d.get("wrapper") is None else where(d["wrapper"]), str(d.get("wrapper_note", "")),
                   resumed=bool(d.get("resumed", False)), phases=dict(d.get("phases") or {}),
                   kernels=dict(d.get("kernels") or {}), shared=bool(d.get("shared", False)))


def _fsync(path: Path) -> None:
    """fsync one file (an error raises: a result that may not be on disk is not published)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_result(c: CompiledPiece, result: Path, uid: str, shared_from: str | None = None) -> None:
    """Write ``c`` (its files under ``result``) as a finished task, durably (module doc)."""
    files = [c.artifact, *(c.kernel_root / rel for rel in c.kernel_files)]
    if c.wrapper is not None:
        files.append(c.wrapper)
    sizes = {}
    for f in files:
        _fsync(f)
        sizes[f.relative_to(result).as_posix()] = f.stat().st_size
    record = {**c.to_json(result), "resumed": False, "shared": False, "uid": uid, "sizes": sizes,
              "shared_from": shared_from}
    with open(result / RESULT_FILE, "w") as out:
        out.write(json.dumps(record))
        out.flush()
        os.fsync(out.fileno())
    fsync_dir(result)


def read_result(out: Path) -> CompiledPiece:
    """The finished task in ``out``, marked ``resumed``, every file checked at its recorded size.
    Raises ``FileNotFoundError`` when there is none; ``ValueError``, ``OSError``, ``KeyError`` or
    ``TypeError`` when it is damaged (a file cut short by a power loss or a full disk)."""
    d = json.loads((out / RESULT_FILE).read_text())
    c = dataclasses.replace(CompiledPiece.from_json(d, out), resumed=True)
    for rel, n in d["sizes"].items():
        if (out / rel).stat().st_size != n:
            raise ValueError(f"{rel} is not {n} bytes")
    return c
