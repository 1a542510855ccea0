"""Compiled pieces shared between entries: a task (unique piece, size) that a stored entry already
holds is taken from it instead of being compiled again.

A piece's unique id is derived from Inductor's own cache key of the piece (graph, input
metadata, Inductor settings), so two entries with the same id at the same size hold the same
compile — provided they were built by the same toolchain (compiler, CPU ISA, torch) and the same
aotc compile logic, which is why only entries whose ``toolchain`` and ``aotc`` key factors equal
this compile's are used. The artifact, its fast-path record and the entry's kernel files are
extracted into the task's result directory exactly as a finished compile leaves it
(``aotc.compile.workers``), so everything after — reload, the numeric check at every size, the
store — runs as for a fresh compile. The blobs are content-addressed: the new entry shares them
with the old one, and a damaged shared blob evicts both (``verify --repair``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from aotc._torch.task_result import RESULT_FILE, CompiledPiece, save_result
from aotc.cache import AotcError, Store
from aotc.records.program import KERNEL_PREFIX, artifact_role, kernel_role, wrapper_role

__all__ = ["seed_from_store"]


def _compatible(entry: Any, factors: dict[str, Any]) -> bool:
    f = entry.factors
    return f.get("toolchain") == factors.get("toolchain") and f.get("aotc") == factors.get("aotc") \
        and f.get("inductor") == factors.get("inductor")


def _extract(store: Store, entry: Any, uid: str, size: int | None, out: Path) -> bool:
    """Write the task's finished result directory ``out`` from ``entry`` (atomic rename)."""
    work = out.parent
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".seed", dir=work))
    try:
        result = partial / "result"
        kernels = sorted(r.removeprefix(KERNEL_PREFIX) for r in entry.blobs if r.startswith(KERNEL_PREFIX))
        dests = {artifact_role(uid, size): result / "artifact.bin"}
        wrapper = wrapper_role(uid, size)
        if wrapper in entry.blobs:
            dests[wrapper] = result / "wrapper.json"
        dests.update({kernel_role(rel): result / "kernels" / rel for rel in kernels})
        store.extract_blobs(entry, dests)
        has_wrapper = wrapper in entry.blobs
        piece = CompiledPiece(result / "artifact.bin", result / "kernels", tuple(kernels), size,
                              f"shared from {entry.key}", 0.0,
                              result / "wrapper.json" if has_wrapper else None,
                              "" if has_wrapper else "shared without a fast-path record")
        save_result(piece, result, uid, shared_from=entry.key)  # as durable as a compile's
        try:
            os.rename(result, out)
        except OSError:  # a concurrent compile finished the task first: same piece
            pass
        return True
    except (AotcError, OSError):  # a damaged or vanished blob: compile it instead
        return False
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def seed_from_store(store: Store, work: Path, tasks: list[tuple[str, int | None]],
                    factors: dict[str, Any]) -> dict[tuple[str, int | None], str]:
    """For each task without a finished result in ``work``, extract it from a compatible stored
    entry (module doc). Returns the tasks seeded, each with the key of the entry it came from."""
    seeded: dict[tuple[str, int | None], str] = {}
    if (work / "check-failed.txt").is_file():  # an earlier attempt failed its check: build anew
        return seeded
    for uid, size in tasks:
        if uid.startswith("x"):  # not keyed by Inductor: the id alone does not prove the same compile
            continue
        out = work / f"{uid}-{size or 'dyn'}"
        if (out / RESULT_FILE).is_file():
            continue
        for key in store.keys_with_role(artifact_role(uid, size)):
            try:
                entry = store.get(key, record=False)
            except AotcError:
                continue
            if _compatible(entry, factors) and _extract(store, entry, uid, size, out):
                seeded[(uid, size)] = key
                break
    return seeded
