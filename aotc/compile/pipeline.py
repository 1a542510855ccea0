"""The compile journey: manifest → model → one Dynamo capture → split at attention → compile each
UNIQUE piece once per shape (dynamic + every compile size) → reload the artifacts as the loader
will → numeric check against eager → one ``store.put``.

A second compile of an unchanged manifest finds the entry without tracing (``aotc.lookup.resolve``) and
does nothing. Nothing is stored when any step fails, the numeric check included.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotc._torch import header_build, inductor_compile, isa_probes
from aotc.cache import StoreReadOnlyError, workdirs
from aotc.compile.pieces import piece_records, trace_and_split
from aotc.compile.reuse import seed_from_store
from aotc.compile.workers import (
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
from aotc.lookup.resolve import base_factors, factory_source, full_factors, resolve
from aotc.lookup.stores import as_manifest, open_store
from aotc.lookup.toolchain import fingerprint, machine_factors
from aotc.manifest import Manifest
from aotc.model.build import make_inputs
from aotc.model.forward import unwrap
from aotc.model.state import named_buffers, named_tensors
from aotc.progress import Progress
from aotc.records.graphcode import encode_graph
from aotc.records.key import compute_key
from aotc.records.program import PROGRAM_ROLE, ArtifactRecord, Program, Slot, artifact_role, kernel_roles, wrapper_role
from aotc.runtime.checking import compare_runs
from aotc.runtime.rehydrate import rehydrate
from aotc.runtime.runner import Runner


@dataclass(frozen=True)
class CompileResult:
    """What a compile did. ``compiles`` counts Inductor compilations actually run (0 on a hit)."""

    key: str
    name: str
    hit: bool
    pieces: int
    unique_pieces: int
    compiles: int
    traces: int
    seconds: dict[str, float]
    bytes_stored: int
    max_abs_err: float | None
    numerics: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    store: str = ""
    resumed: int = 0  # piece compiles taken from an earlier, unfinished compile of the same key
    resumed_from: str = ""  # which: "an interrupted compile" or one whose numeric check failed
    shared: int = 0  # piece compiles taken from other stored entries (aotc.compile.reuse)
    profile: dict[str, float] = field(default_factory=dict)  # compile seconds by step, all pieces
    # C++ kernel libraries the compiles built, and took from the compile's pool (aotc._torch.kernel_pool)
    kernels: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "hit": self.hit, "pieces": self.pieces,
                "unique_pieces": self.unique_pieces, "compiles": self.compiles,
                "traces": self.traces, "seconds": self.seconds, "bytes_stored": self.bytes_stored,
                "max_abs_err": self.max_abs_err, "numerics": self.numerics,
                "warnings": list(self.warnings), "store": self.store, "resumed": self.resumed,
                "resumed_from": self.resumed_from if self.resumed else None,
                "shared": self.shared, "profile": self.profile, "kernels": self.kernels}


def check_sizes(manifest: Manifest) -> list[int]:
    """Sizes of the numeric check: every compile size, one between them, one above the largest."""
    sizes = sorted(set(manifest.compile_sizes))
    between = [n for n in range(2, (max(sizes) if sizes else 8)) if n not in sizes]
    extra = [between[len(between) // 2]] if between else []
    above = [min(manifest.max_tokens, (max(sizes) if sizes else 8) + 3)]
    return sorted(set(sizes + extra + above))


def numeric_check(runner: Runner, model: Any, manifest: Manifest) -> dict[str, Any]:
    """Compare the stitched program with eager at ``check_sizes``; raise above tolerance.
    Both run from the same state; buffers a stateful forward writes are compared too
    (:mod:`aotc.runtime.checking`)."""
    per_size: dict[str, dict[str, float]] = {}
    failures = []
    tol = manifest.tolerance
    buffers = named_buffers(unwrap(model))
    mutated: set[str] = set()
    for n in check_sizes(manifest):
        if n < runner.program.min_dynamic_tokens and n not in manifest.compile_sizes:
            continue
        inputs = make_inputs(manifest, n, seed=1)
        c = compare_runs(runner, model, inputs, buffers, tol.atol, tol.rtol)
        mutated |= c.mutated
        failures += [f"{n} tokens, {f}" for f in c.failures]
        per_size[str(n)] = {"max_abs_err": c.max_abs_err, "max_rel_err": c.max_rel_err}
    if failures:
        raise NumericMismatchError(
            f"compiled program differs from eager beyond atol={tol.atol}, rtol={tol.rtol} "
            f"({manifest.dtype}): " + "; ".join(failures[:6])
            + "; nothing was stored (loosen `tolerance` or check the model)"
        )
    worst = max((v["max_abs_err"] for v in per_size.values()), default=0.0)
    return {"sizes": per_size, "max_abs_err": worst, "atol": tol.atol, "rtol": tol.rtol,
            "mutated_buffers": sorted(mutated)}


def compile_manifest(manifest: Manifest | str | Path, store: Any = None, force: bool = False,
                     progress: Progress | None = None, jobs: int = 1) -> CompileResult:
    """Compile the model a manifest names and put the program in the store (see module doc).
    ``jobs`` > 1 compiles the pieces in that many worker processes (``aotc.compile.workers``)."""
    progress = progress or Progress(quiet=True)
    manifest = as_manifest(manifest)
    store = open_store(store, manifest, create=True)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    toolchain = machine_factors(manifest.device, store.base / "toolchain")
    base = base_factors(manifest, toolchain)
    isa_probes.keep_isa_probes(isa_probes.machine_isa_probe_dir(fingerprint(manifest.device)))
    if not force:
        found = resolve(manifest, store, toolchain, record=False)
        if found.entry is not None:
            seconds["lookup"] = time.perf_counter() - t
            return _hit(found.entry, manifest, seconds, store, traces=0)
    seconds["lookup"] = time.perf_counter() - t
    if store.read_only:  # an up-to-date entry is fine to report; building one is not
        raise StoreReadOnlyError(str(store.root), "compile into it")
    # the kernels' precompiled header (~5 s on a cold machine) builds while this process traces
    header_build.start_header_build(dict(manifest.inductor), isa_probes.isa_probe_files())
    return _compile_traced(manifest, store, force, progress, jobs, toolchain, base, seconds)


def _compile_traced(manifest: Manifest, store: Any, force: bool, progress: Progress, jobs: int,
                    toolchain: dict[str, Any], base: dict[str, Any],
                    seconds: dict[str, float]) -> CompileResult:
    """Trace, split, compile, check and store (a miss of ``compile_manifest``)."""
    traced = trace_and_split(manifest, progress, seconds)
    model, captured, parts, uid_of, first_of, warnings = (
        traced.model, traced.captured, traced.parts, traced.uid_of, traced.first_of, traced.warnings)

    shapes: list[int | None] = [None, *manifest.compile_sizes]
    if captured.dynamic == "static":
        shapes = list(manifest.compile_sizes) or [None]
    t = time.perf_counter()
    code = {**dict(captured.source_files), **factory_source(manifest)}
    factors = full_factors(base, code)
    key = compute_key(factors)
    # finished pieces are kept per key in the store's work directory: a killed compile resumes
    # (--force starts from nothing: its own directory)
    name = key[:32] if not force else f"{key[:32]}-force-{os.getpid()}"
    with workdirs.claim(store.tmp_dir, name) as claimed, \
            tempfile.TemporaryDirectory(prefix="run-", dir=claimed.path) as tmp:
        if not force and store.has(key):  # a concurrent compile stored it while we traced
            claimed.finished()
            return _hit(store.get(key, record=False), manifest, seconds, store, traces=1)
        kernel_root = Path(tmp) / "kernels"
        tasks = [(uid, size) for uid in first_of for size in shapes]
        resumed_source = resumed_from(claimed.path)
        shared = {} if force else seed_from_store(store, claimed.path, tasks, factors)
        compiled = compile_tasks(first_of, tasks, claimed.path, progress, dict(manifest.inductor),
                                 jobs=jobs, fork=True, shared=shared)
        kernel_files = merge_kernels(compiled.values(), kernel_root)
        seconds["compile"] = time.perf_counter() - t
        try:
            progress.phase("check", "reload artifacts, compare with eager")
            t = time.perf_counter()
            artifacts = [ArtifactRecord(uid, size, artifact_role(uid, size),
                                        _wrapper_role(compiled[(uid, size)], uid, size, warnings))
                         for (uid, size) in tasks]
            roles = kernel_roles(kernel_files)
            program = Program(
                name=manifest.name, device=manifest.device, dtype=manifest.dtype,
                slots=_slots(captured.arg_spec, unwrap(model)),
                inputs=tuple(_input_dict(s) for s in manifest.inputs),
                stitch=encode_graph(parts.stitch),
                pieces=piece_records(parts, uid_of),
                artifacts=tuple(artifacts), kernel_roles=roles,
                compile_sizes=tuple(manifest.compile_sizes), capture_sizes=tuple(manifest.capture_sizes),
                max_tokens=manifest.max_tokens, dynamic_mode=captured.dynamic,
                min_dynamic_tokens=_min_dynamic(captured),
                source_files=code, output=_plain_output(manifest.model.output),
            )
            files = artifact_files(artifacts, compiled)
            # reload exactly what will be stored, as the loader will
            by_uid = rehydrate(program, files, kernel_root, dict(manifest.inductor))
            runner = Runner(program, by_uid, model)
            numerics = numeric_check(runner, model, manifest)
            program = _with_numerics(program, numerics)
            seconds["check"] = time.perf_counter() - t
        except AotcError as e:
            # a resumed or shared result may be what failed the check: never take those again
            discard(claimed.path, [task for task, c in compiled.items() if not c.compiled_here])
            if isinstance(e, NumericMismatchError):
                note_check_failed(claimed.path, str(e))
            raise

        t = time.perf_counter()
        blobs: dict[str, Any] = {PROGRAM_ROLE: program.to_json()}
        blobs.update(files)
        for rel, role in roles.items():
            blobs[role] = kernel_root / rel
        n_compiles = sum(c.compiled_here for c in compiled.values())
        steps, kernels = profile(compiled.values()), kernel_builds(compiled.values())
        metadata = {"shared_from": sorted(set(shared.values())),
            "probe": compute_key(base), "pieces": len(parts.pieces), "unique_pieces": len(first_of),
            "compiles": n_compiles, "shapes": ["dynamic" if s is None else str(s) for s in shapes],
            "numerics": numerics, "torch": toolchain["toolchain"].get("torch"), "device": manifest.device,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "profile": steps, "kernels": kernels,
        }
        entry = store.put(key, manifest.name, blobs, factors=factors, metadata=metadata)
        seconds["store"] = time.perf_counter() - t
        claimed.finished()  # stored: the checkpoints go (unless another compile still uses them)
    progress.phase("stored", f"key {key[:16]}… ({entry.stored_size} bytes in {len(entry.blobs)} blobs)")
    return CompileResult(
        key=key, name=manifest.name, hit=False, pieces=len(parts.pieces),
        unique_pieces=len(first_of), compiles=n_compiles, traces=1,
        seconds={k: round(v, 3) for k, v in seconds.items()}, bytes_stored=entry.stored_size,
        max_abs_err=numerics["max_abs_err"], numerics=numerics, warnings=tuple(warnings),
        store=str(store.root), resumed=sum(c.resumed for c in compiled.values()),
        resumed_from=resumed_source, shared=len(shared), profile=steps, kernels=kernels)


def _hit(entry: Any, manifest: Manifest, seconds: dict[str, float], store: Any,
         traces: int) -> CompileResult:
    meta = entry.metadata
    return CompileResult(
        key=entry.key, name=manifest.name, hit=True, pieces=int(meta.get("pieces", 0)),
        unique_pieces=int(meta.get("unique_pieces", 0)), compiles=0, traces=traces,
        seconds=seconds, bytes_stored=0, max_abs_err=meta.get("numerics", {}).get("max_abs_err"),
        numerics=meta.get("numerics", {}), store=str(store.root))


def _wrapper_role(c: inductor_compile.CompiledPiece, uid: str, size: int | None,
                  warnings: list[str]) -> str | None:
    if c.wrapper is None:
        what = "dynamic" if size is None else f"{size} tokens"
        warnings.append(f"piece {uid[:8]} ({what}) loads through Inductor at warm start "
                        f"(slower): {c.wrapper_note}")
        return None
    return wrapper_role(uid, size)


def _slots(arg_spec: Any, model: Any) -> tuple[Slot, ...]:
    """The ArgSpec, with the shape and dtype each parameter/buffer must have when bound."""
    state = named_tensors(model)
    out = []
    for s in arg_spec:
        t = state.get(s.fqn) if s.fqn else None
        out.append(Slot(s.kind, s.fqn, s.index, s.dim,
                        shape=None if t is None else list(t.shape),
                        dtype=None if t is None else str(t.dtype).removeprefix("torch.")))
    return tuple(out)


def _input_dict(s: Any) -> dict[str, Any]:
    d = {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}
    if s.fill == "random" and s.dtype.startswith("int"):  # the valid range (a vocab), for errors
        d.update(low=s.low, high=s.high)
    return d


def _min_dynamic(captured: Any) -> int:
    if captured.dynamic == "backed" and captured.token_range:
        return int(captured.token_range[0] or 1)
    return 1


def _plain_output(output: Any) -> Any:
    return list(output) if isinstance(output, tuple) else output


def _with_numerics(program: Program, numerics: dict[str, Any]) -> Program:
    from dataclasses import replace

    return replace(program, numerics=numerics)


__all__ = ["AotcError", "CompileResult", "compile_manifest", "open_store", "check_sizes"]
