"""The compile core: from the split on, one journey for both front doors — the manifest pipeline
(:mod:`aotc.compile.pipeline`) and the ``torch.compile`` backend (:mod:`aotc.backend.build`).

claim the key's work directory → stored meanwhile? → seed pieces from other stored entries →
compile the (unique piece, shape) tasks → merge their kernels → the ``Program`` (artifact and
kernel roles filled in) → rehydrate exactly what will be stored → the front door's numeric check
→ one ``store.put`` (signed in its transaction when a signing key is set). A failed step
stores nothing; a failed check discards the results taken
from elsewhere (resumed or shared) and is remembered, so the next compile says what it resumes.

The front doors differ only in how they get the pieces, what they key them by, the ``Program``'s
description of the inputs, and how they check numerics: they say so in a :class:`Job`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aotc._torch.task_result import CompiledPiece
from aotc.cache import workdirs
from aotc.compile.reuse import seed_from_store
from aotc.compile.split import Piece
from aotc.compile.workers import (
    Task,
    artifact_files,
    compile_tasks,
    discard,
    kernel_builds,
    merge_kernels,
    note_check_failed,
    profile,
    resumed_from,
)
from aotc.errors import AotcError, NumericMismatchError
from aotc.fleet.trust import Signer
from aotc.gc_pause import gc_paused
from aotc.progress import Progress
from aotc.records.program import PROGRAM_ROLE, ArtifactRecord, Program, artifact_role, kernel_roles, wrapper_role
from aotc.runtime.rehydrate import rehydrate

__all__ = ["Built", "Job", "build"]

# (the Program, its artifacts rehydrated by unique piece and size) -> the check's figures
Check = Callable[[Program, dict[str, dict[int | None, Any]]], dict[str, Any]]


@dataclass(frozen=True)
class Job:
    """What a front door hands the core: the pieces to compile, the key, and its own parts."""

    key: str
    name: str
    factors: dict[str, Any]
    first_of: dict[str, Piece]  # unique piece id -> the first piece with it
    shapes: list[int | None]  # None: the dynamic artifact
    options: dict[str, Any]  # Inductor config patches
    program: Program  # everything but artifacts, kernel roles and numerics
    check: Check
    metadata: dict[str, Any]  # the front door's own fields of the entry's metadata
    jobs: int = 1
    fork: bool = False  # compile in forked workers (jobs > 1)
    # compile even when the key is stored (--force): nothing resumed, nothing shared
    force: bool = False
    # run around the reload and the check (the backend: outside Dynamo's trace)
    around_check: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


@dataclass(frozen=True)
class Built:
    """What :func:`build` did: the entry, or ``stored_meanwhile`` (another compile put it)."""

    entry: Any
    stored_meanwhile: bool = False
    compiles: int = 0  # piece compiles run by this build
    resumed: int = 0
    resumed_from: str = ""
    shared: int = 0
    profile: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def build(store: Any, job: Job, progress: Progress, seconds: dict[str, float],
          signer: Signer | None = None) -> Built:
    """Compile, check and store ``job`` (module doc) — signed by ``signer`` in the same
    transaction as the put, when given. ``seconds`` gains ``compile``, ``check`` and ``store``.
    Raises what failed; nothing is stored then."""
    tasks: list[Task] = [(uid, size) for uid in job.first_of for size in job.shapes]
    # finished pieces are kept per key in the store's work directory: a killed compile resumes
    # (a forced one starts from nothing, in a directory of its own)
    work_name = f"{job.key[:32]}-force-{os.getpid()}" if job.force else job.key[:32]
    # the collector paused throughout (aotc.gc_pause): Inductor's codegen lost ~10 % of a compile
    # to collections, the check's rebuilt programs 0.3 s at 32 layers
    with gc_paused(), workdirs.claim(store.tmp_dir, work_name) as claimed, \
            tempfile.TemporaryDirectory(prefix="run-", dir=claimed.path) as tmp:
        if not job.force and store.has(job.key):  # a concurrent compile (another rank, replica) stored it meanwhile
            claimed.finished()
            return Built(store.get(job.key, record=False), stored_meanwhile=True)
        t = time.perf_counter()
        resumed_source = resumed_from(claimed.path)
        shared = {} if job.force else seed_from_store(store, claimed.path, tasks, job.factors)
        compiled = compile_tasks(job.first_of, tasks, claimed.path, progress, job.options,
                                 jobs=job.jobs, fork=job.fork, shared=shared)
        kernel_root = Path(tmp) / "kernels"
        roles = kernel_roles(merge_kernels(compiled.values(), kernel_root))
        seconds["compile"] = time.perf_counter() - t
        t = time.perf_counter()
        warnings: list[str] = []
        artifacts = tuple(ArtifactRecord(uid, size, artifact_role(uid, size),
                                         _wrapper_role(compiled[(uid, size)], uid, size, warnings))
                          for (uid, size) in tasks)
        program = replace(job.program, artifacts=artifacts, kernel_roles=roles)
        files = artifact_files(artifacts, compiled)
        try:
            progress.phase("check", "reload the artifacts as a warm start will, compare with eager")
            with job.around_check():
                by_uid = rehydrate(program, files, kernel_root, job.options)
                numerics = job.check(program, by_uid)
        except AotcError as e:
            # a resumed or shared result may be what failed the check: never take those again
            discard(claimed.path, [task for task, c in compiled.items() if not c.compiled_here])
            if isinstance(e, NumericMismatchError):
                note_check_failed(claimed.path, str(e))
            raise
        program = replace(program, numerics=numerics)
        seconds["check"] = time.perf_counter() - t

        t = time.perf_counter()
        blobs: dict[str, Any] = {PROGRAM_ROLE: program.to_json(), **files}
        blobs.update({role: kernel_root / rel for rel, role in roles.items()})
        done = Built(None, compiles=sum(c.compiled_here for c in compiled.values()),
                     resumed=sum(c.resumed for c in compiled.values()), resumed_from=resumed_source,
                     shared=len(shared), profile=profile(compiled.values()),
                     kernels=kernel_builds(compiled.values()), warnings=tuple(warnings))
        metadata = {
            "pieces": len(program.pieces), "unique_pieces": len(job.first_of),
            "compiles": done.compiles, "shared": done.shared, "shared_from": sorted(set(shared.values())),
            "shapes": ["dynamic" if s is None else str(s) for s in job.shapes], "numerics": numerics,
            "torch": job.factors["toolchain"].get("torch"), "device": program.device,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "profile": done.profile, "kernels": done.kernels, **job.metadata,
        }
        entry = store.put(job.key, job.name, blobs, factors=job.factors, metadata=metadata,
                          sign=None if signer is None else signer.sign)
        if signer is not None:  # AOTC_SIGNING_KEY: a CI job's entries arrive signed
            progress.phase("signed", f"key {job.key[:16]}… with AOTC_SIGNING_KEY")
        seconds["store"] = time.perf_counter() - t
        claimed.finished()  # stored: the checkpoints go (unless another compile still uses them)
    progress.phase("stored", f"key {job.key[:16]}… ({entry.stored_size} bytes in {len(entry.blobs)} blobs)")
    return replace(done, entry=entry)


def _wrapper_role(c: CompiledPiece, uid: str, size: int | None,
                  warnings: list[str]) -> str | None:
    """The role of a piece's fast-path wrapper; None (and a warning) when it has none."""
    if c.wrapper is None:
        what = "dynamic" if size is None else f"{size} tokens"
        warnings.append(f"piece {uid[:8]} ({what}) loads through Inductor at warm start "
                        f"(slower): {c.wrapper_note}")
        return None
    return wrapper_role(uid, size)
