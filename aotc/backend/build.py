"""The backend's miss: the graph Dynamo handed it → split at the splitting ops → each unique piece
compiled once per shape (dynamic + every compile size) → the stitched program reloaded as a warm
start will load it → checked against the same graph run eagerly → one ``store.put``.

The numeric check runs the split graph twice through one stitch: once with every piece's own FX
graph run eagerly (the reference), once with the compiled artifacts; the splitting pieces
(attention) run eagerly in both. Each run has its own copy of every input that is not a
parameter, so inputs written in place (a cache) are compared as outputs. An out-variant attention
op's output buffer that the graph itself allocates (``torch.empty``, vLLM's ``output``) is zeroed
before the op runs, in both runs (both programs are built with a ``wrap_splitting`` that does it):
where the op leaves it untouched (vLLM's profile run has no attention metadata) both sides then
read zeros, not two different pieces of uninitialised memory.

Sizes checked: the traced one, EVERY compile size and one small dynamic size, the inputs' token
dims cut from the traced example or grown by repeating it along them (values stay valid: token
ids in the vocabulary). All that is stored is checked: a compile size whose inputs cannot be made
(no rows to repeat) is dropped before compiling, with a warning — the checked dynamic artifact
serves it; better than failing the whole graph over one size — and a check of no size raises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from aotc._torch import dynamo, header_build, inductor_compile, isa_probes, kernel_header, static_inputs
from aotc._torch.ops import mutated_args, written_inputs
from aotc.backend.graphkey import graph_device
from aotc.compile.core import Job, build
from aotc.compile.pieces import piece_records, unique_pieces
from aotc.compile.split import SplitResult, split
from aotc.errors import NumericMismatchError
from aotc.log import logger
from aotc.lookup.toolchain import fingerprint
from aotc.progress import Progress
from aotc.records.graphcode import encode_graph
from aotc.records.program import Program, Slot
from aotc.runtime.checking import Comparison, NumericReport, compare_outputs, flat_tensors, tensor_errors
from aotc.runtime.graphcall import GraphRunner
from aotc.runtime.stitched import PieceWrap

__all__ = ["build_entry", "computed_float_dtype", "float_dtype", "graph_slots", "is_training"]

_log = logger("backend")


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
                and not any(isinstance(d, torch.SymInt) for d in val.shape) and not static_inputs.is_fake(ex):
            real[node] = ex
    calls = {str(n.target): n for n in parts.stitch.graph.nodes if n.op == "call_module"}
    pieces = []
    for p in parts.pieces:
        args = calls[p.name].args
        got = {i: real[a] for i, a in enumerate(args) if isinstance(a, torch.fx.Node) and a in real}
        pieces.append(p if p.is_splitting or not got else replace(p, real_inputs=got))
    return SplitResult(parts.stitch, pieces, parts.warnings)


def float_dtype(example_inputs: Sequence[Any]) -> torch.dtype:
    """The dtype of the first floating-point tensor input (float32 when there is none)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x.dtype
    return torch.float32


def _keyed_functions(gm: torch.fx.GraphModule, options: dict[str, Any], key: str) -> dict[str, Any]:
    """Inductor's config patch that lets ``standalone_compile`` save a graph calling Python
    functions of the user's (``allow_in_graph``): torch refuses to cache what it cannot key, but
    the graph's ``key`` holds each such function's code and bound values
    (:mod:`aotc.backend.graphkey`). Each is marked with that key, which torch's own cache key
    (and so the pieces' ids: pieces are shared between entries by id) then includes: torch spells
    such a function by its import path only. {} when the graph calls none."""
    import types

    from aotc._torch.inductor_facts import cacheable_functions

    names = {f"{t.__module__}.{t.__name__}" for n in gm.graph.nodes if n.op == "call_function"
             for t in [n.target] if isinstance(t, types.FunctionType)
             and not str(t.__module__).startswith("torch.")}
    if not names:
        return {}
    marked = {**cacheable_functions(), **dict(options.get("unsafe_marked_cacheable_functions") or {})}
    return {"unsafe_marked_cacheable_functions": {**marked, **{n: f"aotc-graph-{key}" for n in sorted(names)}}}


def is_training(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph is compiled with autograd: Dynamo traced it with grad on and an input
    (a weight) requires grad — as AOTAutograd decides."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                           for x in example_inputs)


def computed_float_dtype(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.dtype:
    """The least precise floating-point dtype the graph computes in: of its inputs and of every
    value its nodes make (a bf16 ``autocast`` region in an fp32 model computes in bf16; so does
    a cast inside the graph). The numeric check's default tolerance is that dtype's."""
    found = {x.dtype for x in example_inputs if isinstance(x, torch.Tensor)}
    for node in gm.graph.nodes:
        val = node.meta.get("example_value", node.meta.get("val"))
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.Tensor):
                found.add(v.dtype)
    floats = [d for d in found if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float32)


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


def _input_at(x: torch.Tensor, shape: list[int], strides: list[int]) -> torch.Tensor | None:
    """One tensor input at ``shape``, laid out as the graph says (``strides``): cut from ``x``,
    or ``x`` repeated whole along each dim that must grow and then cut; None when it cannot be
    made (a dim to grow that is empty, or of a broadcast view)."""
    if len(shape) != x.dim():
        return None
    reps = [1 if w <= h else -(-w // h) if h and 0 not in strides else 0 for w, h in zip(shape, x.shape)]
    if 0 in reps:
        return None
    part = (x.repeat(*reps) if max(reps, default=1) > 1 else x)[tuple(slice(0, w) for w in shape)]
    if list(part.stride()) == strides or 0 in strides:  # (a broadcast view, cut: as it is)
        return part
    return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device).copy_(part)


def _at_size(gm: torch.fx.GraphModule, inputs: Sequence[Any], n: int | None) -> list[Any] | None:
    """The inputs with every token dim at ``n`` (None: as traced): cut from the traced example,
    or grown by repeating it (module doc); None when a size cannot be made."""
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
            shape = [static_inputs.concrete_size(s, n) for s in val.shape]
            strides = [static_inputs.concrete_size(s, n) for s in val.stride()]
            made = _input_at(x, shape, strides)
            if made is None:
                return None
            out.append(made)
        else:
            out.append(x)
    return out


def _checkable(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """The compile sizes the check can make inputs for, and those it cannot (module doc)."""
    try:
        base = _concrete_inputs(gm, example_inputs)
    except NumericMismatchError:  # the check itself says why, before anything is stored
        return list(sizes), []
    ok: list[int] = []
    bad: list[int] = []
    for n in sizes:
        (ok if _at_size(gm, base, n) is not None else bad).append(n)
    return ok, bad


def _traced_size(gm: torch.fx.GraphModule, base: Sequence[Any]) -> int | None:
    """The token count the graph was traced at: its first size symbol's value, else the extent
    of the first tensor dim that is a bare symbol; None for a static graph."""
    symbols = [x for x in base if isinstance(x, int) and not isinstance(x, bool)]
    if symbols:
        return symbols[0]
    for slot, x in zip(graph_slots(gm, base), base):
        if slot.kind == "input" and slot.dim is not None and isinstance(x, torch.Tensor):
            return int(x.shape[slot.dim])
    return None


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


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A copy with ``x``'s strides (``clone`` makes a strided view contiguous): the compiled
    graph asserts the layout it was traced with."""
    if 0 in x.stride():
        return x  # a broadcast view (``expand``): read-only, as eager would refuse a write to it
    if x.is_contiguous() or type(x) is not torch.Tensor:
        return x.clone()
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _zeroing(zero: dict[str, list[int]]) -> PieceWrap:
    """The check's ``wrap_splitting``: a splitting piece with positions in ``zero`` (see
    :func:`_zeroed_outputs`) gets those inputs zeroed before it runs; any other is as it is."""

    def wrap(name: str, call: Any) -> Any:
        positions = tuple(zero.get(name, ()))
        if not positions:
            return call

        def zeroed(*args: Any) -> Any:
            for i in positions:
                if isinstance(args[i], torch.Tensor):
                    args[i].zero_()
            return call(*args)

        return zeroed

    return wrap


def _run(runner: GraphRunner, inputs: Sequence[Any],
         written: frozenset[int] = frozenset()) -> tuple[Any, list[Any]]:
    """One run of the check on its own copy of every input but the weights it only reads (a
    weight the graph writes, as an optimizer step does, is copied too: the check never changes
    the caller's tensors)."""
    mine = [_copy(x) if isinstance(x, torch.Tensor) and (i in written or not isinstance(x, torch.nn.Parameter))
            else x for i, x in enumerate(inputs)]
    return flat_tensors(runner(*mine)), mine


def _gradients(runner: GraphRunner, inputs: Sequence[Any],
               leaves: list[torch.Tensor]) -> tuple[list[bool], list[Any]]:
    """Which outputs carry a grad_fn, and the gradients of a fixed weighted sum of those
    outputs w.r.t. ``leaves``."""
    with torch.enable_grad():
        outs, _ = _run(runner, inputs)
        flags = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        outs = [o for o, f in zip(outs, flags) if f]
        if not outs:
            return flags, [None] * len(leaves)
        gen = torch.Generator(device=outs[0].device).manual_seed(0)
        loss = sum((o.float() * torch.rand(o.shape, generator=gen, device=o.device)).sum() for o in outs)
        return flags, list(torch.autograd.grad(loss, leaves, allow_unused=True))


def _compare_gradients(runner: GraphRunner, reference: GraphRunner, inputs: Sequence[Any],
                       atol: float, rtol: float) -> Comparison:
    """A training graph's gradients (of every input that requires grad: the weights), compiled
    backward vs the graph's own backward run eagerly."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    want_flags, want = _gradients(reference, inputs, leaves)
    got_flags, got = _gradients(runner, inputs, leaves)
    result = Comparison()
    if got_flags != want_flags:
        result.failures.append(f"outputs with a grad_fn: {got_flags}, eager: {want_flags}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None and w is None:
            continue
        abs_err, rel_err, ok = tensor_errors(g, w, atol, rtol)
        result.max_abs_err, result.max_rel_err = max(result.max_abs_err, abs_err), max(result.max_rel_err, rel_err)
        if not ok:
            result.failures.append(f"gradient of input {i}: max abs err {abs_err:.3g}")
    return result


def check(runner: GraphRunner, reference: GraphRunner, gm: torch.fx.GraphModule,
          example_inputs: Sequence[Any], sizes: Sequence[int],
          atol: float, rtol: float) -> dict[str, Any]:
    """Compare the compiled program with the graph run eagerly (module doc) at the traced size,
    every compile size in ``sizes`` and one small dynamic size; raise above the tolerance, or
    when a compile size cannot be checked. Returns the figures per size."""
    base = _concrete_inputs(gm, example_inputs)
    traced = _traced_size(gm, base)
    wanted: list[int | None] = [None]
    if traced is not None:
        wanted += [n for n in sorted({*sizes, min(3, traced)}) if n != traced]
    report = NumericReport(atol, rtol)
    skipped: list[int] = []
    written = written_inputs(gm)
    for n in wanted:
        inputs = _at_size(gm, base, n)
        if inputs is None:
            if n in sizes:  # a static artifact would be stored unchecked
                raise NumericMismatchError(f"compile size {n} cannot be checked (its inputs cannot "
                                           "be made from the traced example); nothing was stored")
            skipped.append(int(n or 0))
            continue
        with torch.no_grad():
            want, theirs = _run(reference, inputs, written)
            got, mine = _run(runner, inputs, written)
        label = str(traced if n is None else n) if traced is not None else "static"
        report.add(label, compare_outputs(got, want, inputs, mine, theirs, atol, rtol))
        if runner.program.training:
            report.add(f"{label} (gradients)", _compare_gradients(runner, reference, inputs,
                                                                  atol, rtol))
    return report.finish("compiled graph differs from the graph run eagerly",
                         "pass aotc.backend(tolerance=…) or check the model", skipped_sizes=skipped)


def build_entry(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], store: Any, key: str,
                factors: dict[str, Any], *, name: str, ops: Sequence[str], sizes: Sequence[int],
                options: dict[str, Any], atol: float, rtol: float,
                progress: Progress, signer: Any = None) -> dict[str, Any]:
    """Split ``gm``, then the compile core (:func:`aotc.compile.core.build`) with the graph's
    own check (module doc); returns the entry's metadata. Nothing is stored when a step fails.
    ``signer``: signs the put in its transaction (:func:`aotc.compile.core.build`)."""
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    device = graph_device(example_inputs)
    machine = fingerprint(device)
    isa_probes.keep_isa_probes(isa_probes.machine_isa_probe_dir(machine))
    kernel_header.keep_headers(machine)
    # the ISA probes, then the kernels' precompiled header in the background (cold machine)
    header_build.start_header_build(dict(options), device)
    parts = _with_real_inputs(split(gm, list(ops)), example_inputs)
    options = {**options, **_keyed_functions(gm, options, key)}
    training = is_training(example_inputs)
    if training:  # AOTAutograd makes each piece's forward and backward: both compiled and stored
        for p in parts.pieces:
            if not p.is_splitting:
                inductor_compile.mark_training(p.gm)
    uid_of, first_of = unique_pieces(parts.pieces, options)
    slots = graph_slots(gm, example_inputs)
    dynamic = any(s.kind == "symbol" or s.dim is not None for s in slots)
    warnings = list(parts.warnings)
    sizes, dropped = _checkable(gm, example_inputs, sizes) if dynamic else (list(sizes), [])
    if dropped:
        note = (f"compile sizes {dropped} are not compiled: the numeric check cannot make inputs "
                "of that many tokens from the traced example (nothing to repeat), and nothing "
                "unchecked is stored; the dynamic artifact serves them")
        _log.warning(f"aotc: warning: graph {key[:16]}…: {note}")
        warnings.append(note)
    seconds["split"] = time.perf_counter() - t
    progress.phase("split", f"{len(parts.pieces)} pieces, {len(first_of)} unique to compile")
    for w in parts.warnings:  # (a dropped size: logged as a warning above)
        progress.note(w)
    program = Program(
        name=name, device=device, dtype=str(float_dtype(example_inputs)).removeprefix("torch."),
        slots=slots, inputs=(), stitch=encode_graph(parts.stitch),
        pieces=piece_records(parts, uid_of), artifacts=(), kernel_roles={},
        compile_sizes=tuple(sizes if dynamic else ()), capture_sizes=(), max_tokens=0,
        dynamic_mode="backed" if dynamic else "static", min_dynamic_tokens=1, source_files={},
        training=training)
    eager_pieces = {p.name: p.gm for p in parts.pieces if not p.is_splitting}
    zeroed_at = _zeroed_outputs(parts)
    zeroed = _zeroing(zeroed_at)

    def graph_check(prog: Program, by_uid: dict[str, dict[int | None, Any]]) -> dict[str, Any]:
        runner = GraphRunner(prog, by_uid, key, wrap_splitting=zeroed)
        reference = GraphRunner(prog, {}, key, modules=eager_pieces, wrap_splitting=zeroed)
        return check(runner, reference, gm, example_inputs, sizes if dynamic else (), atol, rtol)

    job = Job(key=key, name=name, factors=factors, first_of=first_of,
              shapes=[None, *sizes] if dynamic else [None], options=options, program=program,
              check=graph_check, metadata={"kind": "graph", "warnings": warnings},
              around_check=dynamo.outside_trace)
    built = build(store, job, progress, seconds, signer=signer)
    for w in built.warnings:
        progress.note(w)
    return dict(built.entry.metadata)
