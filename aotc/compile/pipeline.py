"""The compile journey: manifest → model → one Dynamo capture → split at attention → compile each
UNIQUE piece once per shape (dynamic + every compile size) → reload the artifacts as the loader
will → numeric check against eager → one ``store.put``.

A second compile of an unchanged manifest finds the entry without tracing (``aotc.lookup.resolve``) and
does nothing. Nothing is stored when any step fails, the numeric check included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aotc._torch import header_build, isa_probes, kernel_header
from aotc.cache import StoreReadOnlyError
from aotc.compile.core import Job, build
from aotc.compile.pieces import build_for_trace, piece_records, trace_and_split
from aotc.context import Context
from aotc.errors import AotcError, NumericMismatchError
from aotc.fleet.tiered import TieredStore, Wanted
from aotc.lookup.resolve import (
    base_factors,
    differs_in_settings,
    factory_source,
    full_factors,
    reread_after_build,
    resolve,
)
from aotc.lookup.stores import as_manifest, open_store
from aotc.lookup.toolchain import fingerprint, machine_factors, remember_fresh_values
from aotc.manifest import Manifest
from aotc.model.build import make_inputs
from aotc.model.forward import unwrap
from aotc.model.state import named_buffers, named_tensors
from aotc.progress import Progress
from aotc.records.graphcode import encode_graph
from aotc.records.key import compute_key
from aotc.records.program import Program, Slot
from aotc.runtime.checking import NumericReport, compare_runs
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
    vllm_records: list[str] = field(default_factory=list)  # a vLLM manifest: vLLM's AOT records stored
    regions: str = ""  # how the capture traced the repeated layers (aotc.compile.repeated)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "hit": self.hit, "pieces": self.pieces,
                "unique_pieces": self.unique_pieces, "compiles": self.compiles,
                "traces": self.traces, "seconds": self.seconds, "bytes_stored": self.bytes_stored,
                "max_abs_err": self.max_abs_err, "numerics": self.numerics,
                "warnings": list(self.warnings), "store": self.store, "resumed": self.resumed,
                "resumed_from": self.resumed_from if self.resumed else None,
                "shared": self.shared, "profile": self.profile, "kernels": self.kernels,
                **({"regions": self.regions} if self.regions else {}),
                **({"vllm_records": self.vllm_records} if self.vllm_records else {})}


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
    tol = manifest.tolerance
    report = NumericReport(tol.atol, tol.rtol)
    buffers = named_buffers(unwrap(model))
    mutated: set[str] = set()
    for n in check_sizes(manifest):
        if n < runner.program.min_dynamic_tokens and n not in manifest.compile_sizes:
            continue
        c = compare_runs(runner, model, make_inputs(manifest, n, seed=1), buffers, tol.atol, tol.rtol)
        mutated |= c.mutated
        report.add(str(n), c)
    return report.finish("compiled program differs from eager", "loosen `tolerance` or check the model",
                         dtype=manifest.dtype, mutated_buffers=sorted(mutated))


def compile_manifest(manifest: Manifest | str | Path, store: Any = None, force: bool = False,
                     progress: Progress | None = None, jobs: int = 1,
                     remote: Any = None, context: Context | None = None) -> CompileResult:
    """Compile the model a manifest names and put the program in the store (see module doc).
    ``jobs`` > 1 compiles the pieces in that many worker processes (``aotc.compile.workers``).
    ``context``: the entry point's :class:`~aotc.context.Context` (default: the environment,
    with ``store`` and ``remote`` as given). With a remote, a local miss is first pulled from
    it; when it has no entry either, the compile runs under the remote's compile lease (one
    process of a fleet compiles, the others wait and pull: :mod:`aotc.fleet.lease`) and is
    pushed there. With a signing key, it is read before any work and every entry stored is
    signed in the same transaction as its put. Where the closest local entry differs in
    process-wide settings, the model is built before the lease and the key read again
    (:func:`aotc.lookup.resolve.reread_after_build`): an entry current then is up to date."""
    if context is not None and (store is not None or remote is not None):
        raise AotcError("aotc.compile: give store=/remote= or context=, not both (a context "
                        "carries its own)")
    context = context or Context.from_env(store=store, remote=remote)
    progress = progress or Progress(quiet=True)
    manifest = as_manifest(manifest)
    signer = context.signer  # a bad AOTC_SIGNING_KEY fails here, before any work
    tiered = context.open_tiered(manifest, create=True)
    tiered.progress = progress
    store = tiered.local
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    toolchain = machine_factors(manifest.device, store.base / "toolchain")
    machine = fingerprint(manifest.device)
    isa_probes.keep_isa_probes(isa_probes.machine_isa_probe_dir(machine))
    kernel_header.keep_headers(machine)
    if not force:
        found = resolve(manifest, store, toolchain, record=False)
        if found.entry is not None:
            seconds["lookup"] = time.perf_counter() - t
            if signer is not None and not store.read_only:
                tiered.sign(found.entry.key)  # stored before the key was set: signed now
            return _hit(found.entry, manifest, seconds, store, traces=0)
    seconds["lookup"] = time.perf_counter() - t
    built_model = None
    if not force and differs_in_settings(found.diffs):
        # the closest entry differs in process-wide settings, which building the model may set
        # (torchao's quantize_): keyed as they are once it is built — built first, and looked up
        # again (an up-to-date entry found so is a compile's hit: no lease, no miss counted)
        built_model = build_for_trace(manifest, progress, seconds)
        built, moved = reread_after_build(manifest, toolchain, store.base / "toolchain")
        if moved:
            toolchain, found = built, resolve(manifest, store, built, record=False)
            if found.entry is not None:
                if signer is not None and not store.read_only:
                    tiered.sign(found.entry.key)
                return _hit(found.entry, manifest, seconds, store, traces=0)
    if store.read_only:  # an up-to-date entry is fine to report; building one is not
        raise StoreReadOnlyError(str(store.root), "compile into it")

    def compile_here() -> CompileResult:
        # the kernels' precompiled header (one long g++ run on a cold machine) builds while this
        # process builds and traces the model, after the ISA probes (short g++ runs, kept per
        # machine: its phase is ~0 on a warm one) — only in a process that compiles (not in a
        # replica waiting on a lease)
        t = time.perf_counter()
        header_build.start_header_build(dict(manifest.inductor), manifest.device)
        seconds["isa_probes"] = time.perf_counter() - t
        try:
            model = built_model if built_model is not None else build_for_trace(manifest, progress, seconds)
            return _compile_built(manifest, tiered, force, progress, jobs, toolchain, seconds, model)
        finally:  # the kernels' header build it started ends with this call (nothing left behind)
            header_build.wait_for_header_builds()

    if force:
        result = compile_here()
        tiered.push(result.key, manifest.name)
        return result
    t = time.perf_counter()
    served = tiered.get_or_build(Wanted.by_manifest(manifest, toolchain), compile_here)
    if served.built is not None:
        return served.built
    if served.pulled:
        seconds["pull"] = time.perf_counter() - t
    return _hit(served.entry, manifest, seconds, store, traces=0)


def _compile_built(manifest: Manifest, tiered: TieredStore, force: bool, progress: Progress, jobs: int,
                   looked_up: dict[str, Any], seconds: dict[str, float], model: Any) -> CompileResult:
    """A miss of ``compile_manifest`` once the model is built: keyed by the settings the compile
    runs under — read now, after the build. A build that changed process-wide settings
    (torchao's ``quantize_`` turns Inductor options on) compiles under them, so its key is not
    the one looked up (``looked_up``'s: read before this build, or after a build
    ``compile_manifest`` made before its lease): that key is looked up (and leased) first — a
    store that has it is a hit, built by a process that built the model too."""
    # (a setting the manifest patches moves no key: the lease of an unchanged key is the one
    # this process holds)
    machine, moved = reread_after_build(manifest, looked_up, tiered.local.base / "toolchain")
    base = base_factors(manifest, machine)
    if force or not moved:
        return _compile_traced(manifest, tiered, force, progress, jobs, base, seconds, model=model)
    progress.note(f"building the model changed process-wide settings ({', '.join(moved[:4])}): "
                  "keyed and compiled as they are now")
    served = tiered.get_or_build(
        Wanted.by_manifest(manifest, machine),
        lambda: _compile_traced(manifest, tiered, force, progress, jobs, base, seconds, model=model))
    if served.built is not None:
        return served.built
    entry = served.entry
    if entry is not None and tiered.signer is not None and not tiered.local.read_only:
        tiered.sign(entry.key)  # as a hit before the build: stored before the key was set
    return _hit(entry, manifest, seconds, tiered.local, traces=0)


def _compile_traced(manifest: Manifest, tiered: TieredStore, force: bool, progress: Progress, jobs: int,
                    base: dict[str, Any], seconds: dict[str, float], regions: str | None = None,
                    model: Any = None) -> CompileResult:
    """Trace and split ``model`` (None: built again), then the compile core. A program whose
    numeric check fails with layers stamped out (``aotc.compile.stamp``: what a stamped layer
    reads beyond its arguments and weights — a global the model changes between layers — is not
    seen) is traced again with every layer traced, under the same key (the graph is the same
    but for that), before anything is stored; ``regions``: that retry's ``"off"``."""
    store = tiered.local
    traced = trace_and_split(manifest, progress, seconds, regions, model=model)
    model, captured, parts = traced.model, traced.captured, traced.parts
    shapes: list[int | None] = [None, *manifest.compile_sizes]
    if captured.dynamic == "static":
        shapes = list(manifest.compile_sizes) or [None]
    code = {**dict(captured.source_files), **factory_source(manifest)}
    factors = full_factors(base, code)
    key = compute_key(factors)
    program = Program(
        name=manifest.name, device=manifest.device, dtype=manifest.dtype,
        slots=_slots(captured.arg_spec, unwrap(model)),
        inputs=tuple(_input_dict(s) for s in manifest.inputs),
        stitch=encode_graph(parts.stitch), pieces=piece_records(parts, traced.uid_of),
        artifacts=(), kernel_roles={},
        compile_sizes=tuple(manifest.compile_sizes), capture_sizes=tuple(manifest.capture_sizes),
        max_tokens=manifest.max_tokens, dynamic_mode=captured.dynamic,
        min_dynamic_tokens=_min_dynamic(captured), source_files=code,
        output=_plain_output(manifest.model.output))
    job = Job(key=key, name=manifest.name, factors=factors, first_of=traced.first_of, shapes=shapes,
              options=dict(manifest.inductor), program=program,
              check=lambda prog, by_uid: numeric_check(Runner(prog, by_uid, model), model, manifest),
              metadata={"probe": compute_key(base)}, jobs=jobs, fork=True, force=force)
    try:
        built = build(store, job, progress, seconds, signer=tiered.signer)
    except NumericMismatchError:
        if not traced.stamped:
            raise
        why = "the numeric check failed with layers stamped out"
        progress.note(f"{why}: every layer traced again")
        result = _compile_traced(manifest, tiered, force, progress, jobs, base, seconds, "off")
        return replace(result, regions=f"traced every layer ({why})")
    # the toolchain memo's Inductor settings as a fresh process reads them (a fresh interpreter,
    # once per memo; after the compile: no fork of a worker meets its pipes)
    remember_fresh_values(manifest.device, store.base / "toolchain")
    if built.stored_meanwhile:
        return _hit(built.entry, manifest, seconds, store, traces=1)
    numerics = built.entry.metadata["numerics"]
    return CompileResult(
        key=key, name=manifest.name, hit=False, pieces=len(parts.pieces),
        unique_pieces=len(traced.first_of), compiles=built.compiles, traces=1,
        seconds={k: round(v, 3) for k, v in seconds.items()}, bytes_stored=built.entry.stored_size,
        max_abs_err=numerics["max_abs_err"], numerics=numerics,
        warnings=(*traced.warnings, *built.warnings), store=str(store.root), resumed=built.resumed,
        resumed_from=built.resumed_from, shared=built.shared, profile=built.profile,
        kernels=built.kernels, regions=traced.regions)


def _hit(entry: Any, manifest: Manifest, seconds: dict[str, float], store: Any,
         traces: int) -> CompileResult:
    meta = entry.metadata
    return CompileResult(
        key=entry.key, name=manifest.name, hit=True, pieces=int(meta.get("pieces", 0)),
        unique_pieces=int(meta.get("unique_pieces", 0)), compiles=0, traces=traces,
        seconds=seconds, bytes_stored=0, max_abs_err=meta.get("numerics", {}).get("max_abs_err"),
        numerics=meta.get("numerics", {}), store=str(store.root))


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


__all__ = ["AotcError", "CompileResult", "compile_manifest", "open_store", "check_sizes"]
