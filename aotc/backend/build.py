"""The backend's miss: the graph Dynamo handed it → split at the splitting ops → each unique piece
compiled once per shape (dynamic + every compile size) → the stitched program reloaded as a warm
start will load it → checked against the same graph run eagerly → one ``store.put``.

The numeric check runs the split graph twice through one stitch: once with every piece's own FX
graph run eagerly (the reference), once with the compiled artifacts; the splitting pieces
(attention) run eagerly in both. Each run has its own copy of every input that is not a
parameter, so inputs written in place (a cache) are compared as outputs. An out-variant attention
op's output buffer that the graph itself allocates (``torch.empty``, vLLM's ``output``) is zeroed
before the op runs, in both runs: where the op leaves it untouched (vLLM's profile run has no
attention metadata) both sides then read zeros, not two different pieces of uninitialised memory.
Sizes checked: the traced one, each compile size and one small dynamic size, with the inputs'
token dims narrowed from the traced example (a size above it cannot be made and is skipped).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from aotc._torch import dynamo, inductor_compile, isa_probes
from aotc._torch.ops import mutated_args
from aotc.cache import workdirs
from aotc.compile.pieces import piece_records, piece_uid
from aotc.compile.reuse import seed_from_store
from aotc.compile.split import SplitResult, split
from aotc.compile.workers import artifact_files, compile_tasks, discard, merge_kernels, note_check_failed
from aotc.errors import AotcError, NumericMismatchError
from aotc.lookup.toolchain import fingerprint
from aotc.progress import Progress
from aotc.records.graphcode import encode_graph
from aotc.records.program import PROGRAM_ROLE, ArtifactRecord, Program, Slot, artifact_role, kernel_roles, wrapper_role
from aotc.runtime.checking import flat_tensors, same, tensor_errors
from aotc.runtime.graphcall import GraphRunner
from aotc.runtime.rehydrate import rehydrate

__all__ = ["build_entry", "graph_slots"]


def graph_slots(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Slot, ...]:
    """One slot per placeholder: ``symbol`` (a size), ``input`` (a tensor; ``dim`` = its first
    dim that is a plain size symbol) or ``opaque`` (passed through as given)."""
    slots = []
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, (node, ex) in enumerate(zip(nodes, example_inputs)):
        val = node.meta.get("example_value", ex)
        if isinstance(val, torch.SymInt):
            slots.append(Slot("symbol", index=i))
        elif isinstance(val, torch.Tensor):
            dim = next((d for d, s in enumerate(val.shape)
                        if dynamo.is_plain_symbol(s)), None)
            slots.append(Slot("input", index=i, dim=dim, dtype=str(val.dtype).removeprefix("torch.")))
        else:
            slots.append(Slot("opaque", index=i))
    return tuple(slots)


def _with_real_inputs(parts: SplitResult, example_inputs: Sequence[Any]) -> SplitResult:
    """Each compiled piece with the real values of the graph inputs of fixed shape it takes
    (weights, vLLM's oneDNN handles): Inductor's fast-path check and static compiles run on them."""
    from dataclasses import replace

    placeholders = [n for n in parts.stitch.graph.nodes if n.op == "placeholder"]
    real = {}
    for node, ex in zip(placeholders, example_inputs):
        val = node.meta.get("example_value", ex)
        if isinstance(ex, torch.Tensor) and isinstance(val, torch.Tensor) \
                and not any(isinstance(d, torch.SymInt) for d in val.shape) and not _is_fake(ex):
            real[node] = ex
    calls = {str(n.target): n for n in parts.stitch.graph.nodes if n.op == "call_module"}
    pieces = []
    for p in parts.pieces:
        args = calls[p.name].args
        got = {i: real[a] for i, a in enumerate(args) if isinstance(a, torch.fx.Node) and a in real}
        pieces.append(p if p.is_splitting or not got else replace(p, real_inputs=got))
    return SplitResult(parts.stitch, pieces, parts.warnings)


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor" or t.device.type == "meta"


def _float_dtype(example_inputs: Sequence[Any]) -> torch.dtype:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x.dtype
    return torch.float32


def _concrete_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """The example inputs with each size symbol replaced by its traced value (torch's AOT path
    hands the backend ``SymInt`` examples)."""
    out = []
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            hint = dynamo.symint_hint(x)
            if hint is None:
                raise NumericMismatchError("a size symbol of the graph has no traced value; cannot "
                                           "run the numeric check")
            out.append(hint)
        else:
            out.append(x)
    return out


def _at_size(gm: torch.fx.GraphModule, inputs: Sequence[Any], n: int | None) -> list[Any] | None:
    """The inputs with every token dim narrowed to ``n`` (None: as traced); None if impossible."""
    if n is None:
        return list(inputs)
    nodes = [p for p in gm.graph.nodes if p.op == "placeholder"]
    out: list[Any] = []
    for node, x in zip(nodes, inputs):
        val = node.meta.get("example_value")
        if isinstance(val, torch.SymInt):
            out.append(n)
        elif isinstance(val, torch.Tensor) and isinstance(x, torch.Tensor) \
                and any(isinstance(s, torch.SymInt) for s in val.shape):
            shape = [inductor_compile.concrete_size(s, n) for s in val.shape]
            if any(want > have for want, have in zip(shape, x.shape)):
                return None
            out.append(x[tuple(slice(0, w) for w in shape)].contiguous())  # strides as at n
        else:
            out.append(x)
    return out


def _zeroed_outputs(parts: SplitResult) -> dict[str, list[int]]:
    """Per splitting piece, the positions of its inputs the op writes that an earlier piece
    allocated (not graph inputs): zeroed before the op in both runs of the check."""
    stitch_inputs = {n for n in parts.stitch.graph.nodes if n.op == "placeholder"}
    calls = {str(n.target): n for n in parts.stitch.graph.nodes if n.op == "call_module"}
    out: dict[str, list[int]] = {}
    for p in parts.pieces:
        if not p.is_splitting:
            continue
        placeholders = [n for n in p.gm.graph.nodes if n.op == "placeholder"]
        written = {id(a) for n in p.gm.graph.nodes if n.op == "call_function" for a in mutated_args(n)
                   if isinstance(a, torch.fx.Node)}
        fed = calls[p.name].args
        out[p.name] = [i for i, ph in enumerate(placeholders)
                       if id(ph) in written and i < len(fed) and fed[i] not in stitch_inputs]
    return out


def _run(runner: GraphRunner, inputs: Sequence[Any], zero: dict[str, list[int]]) -> tuple[Any, list[Any]]:
    mine = [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
            else x for x in inputs]

    def hook(name: str, call: Any, args: Sequence[Any]) -> Any:
        for i in zero.get(name, ()):
            if isinstance(args[i], torch.Tensor):
                args[i].zero_()
        return call(*args)

    runner.splitting_hook = hook
    try:
        return flat_tensors(runner(*mine)), mine
    finally:
        runner.splitting_hook = None


def check(runner: GraphRunner, reference: GraphRunner, gm: torch.fx.GraphModule,
          example_inputs: Sequence[Any], parts: SplitResult, sizes: Sequence[int],
          atol: float, rtol: float) -> dict[str, Any]:
    """Compare the compiled program with the graph run eagerly (module doc); raise above the
    tolerance. Returns the figures per size."""
    base = _concrete_inputs(gm, example_inputs)
    symbols = [x for x in base if isinstance(x, int) and not isinstance(x, bool)]
    traced = symbols[0] if symbols else None
    wanted: list[int | None] = [None]
    if traced is not None:
        wanted += [n for n in sorted({*sizes, min(3, traced)}) if n != traced]
    zero = _zeroed_outputs(parts)
    per_size: dict[str, Any] = {}
    failures: list[str] = []
    skipped: list[int] = []
    for n in wanted:
        inputs = _at_size(gm, base, n)
        if inputs is None:
            skipped.append(int(n or 0))
            continue
        label = str(traced if n is None else n) if traced is not None else "static"
        with torch.no_grad():
            want, theirs = _run(reference, inputs, zero)
            got, mine = _run(runner, inputs, zero)
        pairs = [(f"output {i}", g, w) for i, (g, w) in enumerate(zip(got, want))]
        if len(got) != len(want):
            failures.append(f"{label} tokens: {len(got)} outputs, eager has {len(want)}")
        pairs += [(f"input {i} (written in place)", m, t) for i, (x, m, t)
                  in enumerate(zip(inputs, mine, theirs))
                  if isinstance(x, torch.Tensor) and not (same(m, x) and same(t, x))]
        worst_abs = worst_rel = 0.0
        for what, g, w in pairs:
            if not isinstance(w, torch.Tensor):
                continue
            a, r, ok = tensor_errors(g, w, atol, rtol)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
            if not ok:
                failures.append(f"{label} tokens, {what}: max abs err {a:.3g}")
        per_size[label] = {"max_abs_err": worst_abs, "max_rel_err": worst_rel}
    if failures:
        raise NumericMismatchError(
            f"compiled graph differs from the graph run eagerly beyond atol={atol}, rtol={rtol}: "
            + "; ".join(failures[:6]) + "; nothing was stored (pass aotc.backend(tolerance=…) "
            "or check the model)")
    worst = max((v["max_abs_err"] for v in per_size.values()), default=0.0)
    return {"sizes": per_size, "max_abs_err": worst, "atol": atol, "rtol": rtol,
            "skipped_sizes": skipped}


def build_entry(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], store: Any, key: str,
                factors: dict[str, Any], *, name: str, ops: Sequence[str], sizes: Sequence[int],
                options: dict[str, Any], atol: float, rtol: float,
                progress: Progress) -> dict[str, Any]:
    """Compile, check and store the program of ``gm`` under ``key`` (module doc); returns the
    entry's metadata. Nothing is stored when a step fails."""
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    device = str(next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), "cpu"))
    isa_probes.keep_isa_probes(isa_probes.machine_isa_probe_dir(fingerprint(device)))
    parts = _with_real_inputs(split(gm, list(ops)), example_inputs)
    uid_of: dict[str, str] = {}
    first_of: dict[str, Any] = {}
    for p in parts.pieces:
        if not p.is_splitting:
            uid_of[p.name] = uid = piece_uid(p, options)
            first_of.setdefault(uid, p)
    slots = graph_slots(gm, example_inputs)
    dynamic = any(s.kind == "symbol" or s.dim is not None for s in slots)
    shapes: list[int | None] = [None, *sizes] if dynamic else [None]
    seconds["split"] = time.perf_counter() - t
    progress.phase("split", f"{len(parts.pieces)} pieces, {len(first_of)} unique to compile")
    for w in parts.warnings:
        progress.note(w)
    with workdirs.claim(store.tmp_dir, key[:32]) as claimed, \
            tempfile.TemporaryDirectory(prefix="run-", dir=claimed.path) as tmp:
        if store.has(key):  # a concurrent compile (another rank, replica) stored it meanwhile
            claimed.finished()
            return dict(store.get(key, record=False).metadata)
        t = time.perf_counter()
        tasks = [(uid, size) for uid in first_of for size in shapes]
        shared = seed_from_store(store, claimed.path, tasks, factors)
        compiled = compile_tasks(first_of, tasks, claimed.path, progress, options, shared=shared)
        kernel_root = Path(tmp) / "kernels"
        kernel_files = merge_kernels(compiled.values(), kernel_root)
        seconds["compile"] = time.perf_counter() - t
        t = time.perf_counter()
        artifacts = [ArtifactRecord(uid, size, artifact_role(uid, size),
                                    None if compiled[(uid, size)].wrapper is None
                                    else wrapper_role(uid, size))
                     for (uid, size) in tasks]
        roles = kernel_roles(kernel_files)
        program = Program(
            name=name, device=device,
            dtype=str(_float_dtype(example_inputs)).removeprefix("torch."), slots=slots, inputs=(),
            stitch=encode_graph(parts.stitch),
            pieces=piece_records(parts, uid_of),
            artifacts=tuple(artifacts), kernel_roles=roles, compile_sizes=tuple(sizes if dynamic else ()),
            capture_sizes=(), max_tokens=0, dynamic_mode="backed" if dynamic else "static",
            min_dynamic_tokens=1, source_files={})
        files: dict[str, Any] = dict(artifact_files(artifacts, compiled))
        try:
            progress.phase("check", "reload the artifacts, compare with the graph run eagerly")
            with dynamo.outside_trace():
                by_uid = rehydrate(program, files, kernel_root, options)
                runner = GraphRunner(program, by_uid, key)
                reference = GraphRunner(program, {}, key, modules={p.name: p.gm for p in parts.pieces
                                                                   if not p.is_splitting})
                numerics = check(runner, reference, gm, example_inputs, parts, sizes if dynamic else (),
                                 atol, rtol)
        except AotcError as e:
            discard(claimed.path, [task for task, c in compiled.items() if not c.compiled_here])
            if isinstance(e, NumericMismatchError):
                note_check_failed(claimed.path, str(e))
            raise
        from dataclasses import replace

        program = replace(program, numerics=numerics)
        seconds["check"] = time.perf_counter() - t
        t = time.perf_counter()
        blobs: dict[str, Any] = {PROGRAM_ROLE: program.to_json(), **files}
        for rel, role in roles.items():
            blobs[role] = kernel_root / rel
        metadata = {
            "kind": "graph", "pieces": len(parts.pieces), "unique_pieces": len(first_of),
            "compiles": sum(c.compiled_here for c in compiled.values()), "shared": len(shared),
            "shared_from": sorted(set(shared.values())),
            "shapes": ["dynamic" if s is None else str(s) for s in shapes], "numerics": numerics,
            "torch": factors["toolchain"].get("torch"), "device": program.device,
            "warnings": list(parts.warnings), "seconds": {k: round(v, 3) for k, v in seconds.items()},
        }
        entry = store.put(key, name, blobs, factors=factors, metadata=metadata)
        seconds["store"] = time.perf_counter() - t
        claimed.finished()
    progress.phase("stored", f"key {key[:16]}… ({entry.stored_size} bytes in {len(entry.blobs)} blobs)")
    return metadata
