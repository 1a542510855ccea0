"""Compiling and saving pieces with Inductor (``standalone_compile``) and their cache keys: the
compile side of the fence around ``torch._inductor``.
Written for torch 2.11–2.13, API differences feature-checked; tested on 2.13.0 (CPU).

Shipping kernels: a ``standalone_compile`` artifact holds the wrapper and kernel *sources*
(Triton binaries too) but not the compiled C++ libraries, so a fresh process would run the C++
compiler again. Each compile therefore runs in :func:`~aotc._torch.inductor_load.inductor_cache_dir`
pointed at a fresh dir; the binaries found there are its *kernel files* (relative paths),
restored under one root at load so Inductor finds each under the key it computes (the ISA probe
libraries too, :mod:`aotc._torch.isa_probes`). :func:`compile_piece` also records the fast-path
record of :mod:`aotc._torch.wrapper` for every piece that qualifies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.fx

from aotc._torch import kernel_batch, kernel_checks, kernel_pool, training_path, wrapper
from aotc._torch.dynamo import is_restart
from aotc._torch.global_factors import cpu_system_info
from aotc._torch.inductor_facts import _config_patch
from aotc._torch.inductor_load import in_process_isa_probes, inductor_cache_dir
from aotc._torch.inductor_load import kernel_files as _kernel_files
from aotc._torch.isa_probes import isa_probe_files, seed_isa_probes
from aotc._torch.ops import graph_returns_tuple, undefined_outputs, written_inputs
from aotc._torch.static_inputs import static_example_inputs
from aotc._torch.task_result import CompiledPiece
from aotc.counters import COUNTERS as _ours
from aotc.errors import CompileError

__all__ = ["PendingPiece", "build_kernels", "compile_piece", "finish_piece", "mark_training",
           "piece_cache_key", "start_piece", "static_example_inputs", "structural_key"]

_CHECK_TOKENS = 3  # token count the dynamic artifact's fast path is checked at
_TRAINING = "aotc_training"  # a piece's graph meta: compile it with autograd (forward + backward)


def mark_training(gm: torch.fx.GraphModule) -> None:
    """Compile ``gm`` with autograd: AOTAutograd makes its forward and backward, both compiled
    and saved in the artifact (else it is compiled for inference, under ``no_grad``)."""
    gm.meta[_TRAINING] = True


def _grad_mode(gm: torch.fx.GraphModule) -> Any:
    return torch.enable_grad() if gm.meta.get(_TRAINING) else torch.no_grad()


def _sc_module() -> Any:
    # ``torch._inductor.standalone_compile`` the attribute is the function; get the module.
    return importlib.import_module("torch._inductor.standalone_compile")


def _is_symbolic(v: Any) -> bool:
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)


def _fallback_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], tag: str) -> str:
    """sha256 of the graph's structure (node names dropped) + input metadata + ``torch_key``."""
    import sympy
    from torch._inductor.codecache import torch_key

    idx: dict[torch.fx.Node, int] = {}
    syms: dict[Any, Any] = {}
    lines = [tag, torch_key().hex()]

    def canon(x: Any) -> str:  # size symbols renamed in order of appearance
        if not isinstance(x, torch.SymInt):
            return str(x)
        expr = x.node.expr
        for f in sorted(expr.free_symbols, key=str):
            syms.setdefault(f, sympy.Symbol(f"S{len(syms)}", integer=True))
        return str(expr.xreplace(syms))

    for v in example_inputs:
        if isinstance(v, torch.Tensor):
            lines.append(f"T {v.dtype} {v.device.type} {[canon(d) for d in v.shape]} "
                         f"{[canon(d) for d in v.stride()]} {v.requires_grad}")
        else:
            lines.append(f"V {type(v).__name__} {canon(v)}")
    for i, n in enumerate(gm.graph.nodes):
        idx[n] = i
        if n.op == "call_function":
            mod = getattr(n.target, "__module__", "")
            tgt = f"{mod}.{getattr(n.target, '__qualname__', n.target)}"
        else:
            tgt = "" if n.op in ("placeholder", "output") else str(n.target)
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{idx[a]}")
        lines.append(f"{n.op} {tgt} {args!r}")
        if n.op == "get_attr":  # a subgraph (a cond's branch) or a constant: its content counts
            lines.append(_attr_text(gm, str(n.target)))
    return "aotc-" + hashlib.sha256("\n".join(lines).encode()).hexdigest()


def structural_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """A cheap key of a piece's structure and inputs' metadata (no AOTAutograd trace): pieces of
    one split with equal structural keys compile alike, so their :func:`piece_cache_key` is
    computed once (the layers of a transformer)."""
    tag = "structure:training" if gm.meta.get(_TRAINING) else "structure"
    return _fallback_key(gm, example_inputs, tag)


def _attr_text(gm: torch.fx.GraphModule, target: str) -> str:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, torch.fx.GraphModule):
        return _fallback_key(obj, [], "subgraph")
    if isinstance(obj, torch.Tensor):
        data = obj.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return f"tensor {data.dtype} {list(data.shape)} {hashlib.sha256(raw).hexdigest()}"
    return f"{type(obj).__module__}.{type(obj).__qualname__} {obj!r}"


def piece_cache_key(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    dynamic: bool,
    *,
    size: int | None = None,
    options: dict[str, Any] | None = None,
) -> str:
    """Stable key of "this piece compiled this way", used to dedup identical pieces.

    ``dynamic=True``: keyed on the symbolic example inputs (``dynamic_shapes="from_graph"``).
    ``dynamic=False``: keyed on concrete inputs; pass them, or fake inputs plus ``size``. Uses
    Inductor's own AOTAutograd cache key (``standalone_compile.autograd_cache_key``, torch >=
    2.12), which is blind to placeholder names, so the same layer at different depths gives the
    same key. Falls back to a sha256 over the canonicalized graph + input metadata.
    """
    options = dict(options or {})
    inputs = list(example_inputs)
    if not dynamic and size is not None:
        inputs = static_example_inputs(inputs, size)
    elif not dynamic and any(_is_symbolic(v) for v in inputs):
        raise ValueError("piece_cache_key(dynamic=False) needs concrete inputs or a size")
    tag = "dynamic" if dynamic else f"static:{[tuple(getattr(v, 'shape', ())) for v in inputs]}"
    tag += ":training" if gm.meta.get(_TRAINING) else ""
    fn = getattr(_sc_module(), "autograd_cache_key", None)
    if fn is not None and graph_returns_tuple(gm):
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
        from torch._inductor.codecache import BypassFxGraphCache
        mode = "from_graph" if dynamic else "from_example_inputs"
        try:
            with _grad_mode(gm), _config_patch(options), cpu_system_info():  # no Triton hash on a CPU host
                key = fn(gm, inputs, mode)
            key = key[0] if isinstance(key, tuple) else key
            return f"{key}:{_options_digest(options)}" if options else str(key)
        except (NotImplementedError, RuntimeError, AssertionError, BypassFxGraphCache,
                BypassAOTAutogradCache):
            pass  # e.g. a graph Inductor's key cannot pickle: the structural key below
    return _fallback_key(gm, inputs, tag + json.dumps(options, sort_keys=True, default=str))


# Inductor's own timers (``dynamo_timed`` names) worth telling apart in a compile's profile
_METRICS = {"GraphLowering.run": "lowering", "GraphLowering.codegen": "codegen",
            "compile_file": "c++ compiler", "PyCodeCache.load_by_key_path": "load module",
            "async_compile.wait": "wait for kernels"}


def _timed_metrics() -> dict[str, float]:
    """Total seconds so far of each of :data:`_METRICS` (``torch._dynamo.utils``' record)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as m
    except ImportError:
        return {}
    return {k: float(sum(m.get(k, ()))) for k in _METRICS}


def _options_digest(options: dict[str, Any]) -> str:
    blob = json.dumps(options, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass
class PendingPiece:
    """A piece :func:`start_piece` compiled whose kernels are held in a
    :class:`~aotc._torch.kernel_batch.KernelBatch` (not built yet); :func:`finish_piece` ends it.
    Its scratch Inductor cache dir ``tmp`` lives until then (:meth:`discard` on failure)."""

    gm: torch.fx.GraphModule
    inputs: list[Any]
    size: int | None
    out_dir: Path
    key: str
    tmp: Path
    art: Any
    seeded: set[str]
    probes: dict[str, Path]
    pool: Path | None
    real: dict[int, Any]
    phases: dict[str, float]
    t0: float
    batch: kernel_batch.KernelBatch

    def discard(self) -> None:
        """Remove the scratch dir (the piece is not finished)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def compile_piece(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    size: int | None,
    out_dir: Path,
    options: dict[str, Any] | None = None,
    tmp_root: Path | None = None,
    real_inputs: dict[int, Any] | None = None,
    key: str | None = None,
    pool: Path | None = None,
) -> CompiledPiece:
    """Compile one piece with Inductor and save it under ``out_dir``.

    ``key``: the record's name for this compile when the caller has one (the unique-piece id
    and size); otherwise :func:`piece_cache_key` is computed — an AOTAutograd trace of the
    piece, ~30% of a small piece's compile, so the compile journey passes its own.
    ``real_inputs``: real values for some input positions (a graph input of fixed shape: a
    weight, vLLM's prepacked oneDNN handle — a 0-d int64 tensor no zero may stand in for), used
    wherever a real value is needed: the static compile's inputs and the fast-path check's.

    ``size=None``: dynamic (``dynamic_shapes="from_graph"``, symbolic fake inputs); an int:
    static for that token count (real inputs of that size, ``"from_example_inputs"``).
    ``options``: Inductor config patches. Writes ``out_dir/artifact.bin`` and the kernel files
    under ``out_dir/kernels/``; raises :class:`CompileError` on any failure. Inductor's scratch
    cache dir is made under ``tmp_root`` (default: the system's temp dir). ``pool``: the job's
    :mod:`~aotc._torch.kernel_pool` — kernels already built there are not built again, and the
    ones this compile builds are added to it. (:func:`start_piece` then :func:`finish_piece`,
    with the piece's kernels built by one compiler run in between.)
    """
    batch = kernel_batch.KernelBatch()
    pending = start_piece(gm, example_inputs, size, out_dir, options, tmp_root, real_inputs, key,
                          pool, batch)
    try:
        build_kernels(batch, f"piece ({'dynamic' if size is None else f'size {size}'}) into {out_dir}")
        return finish_piece(pending)
    finally:
        pending.discard()


def build_kernels(batch: kernel_batch.KernelBatch, what: str) -> None:
    """Build the kernels held in ``batch``; a kernel the C++ compiler refuses is a
    :class:`CompileError` naming ``what`` they belong to."""
    try:
        batch.build()
    except Exception as e:  # noqa: BLE001 - Inductor's own error types
        raise CompileError(f"the C++ compiler failed on a kernel of {what}: "
                           f"{type(e).__name__}: {str(e)[-800:]}") from e


def start_piece(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    size: int | None,
    out_dir: Path,
    options: dict[str, Any] | None,
    tmp_root: Path | None,
    real_inputs: dict[int, Any] | None,
    key: str | None,
    pool: Path | None,
    batch: kernel_batch.KernelBatch,
) -> PendingPiece:
    """The first half of :func:`compile_piece` (same arguments): Inductor compiles and the
    artifact is saved, the piece's C++ kernels held in ``batch`` — the caller builds the batch
    (the kernels of several pieces by one compiler run), then calls :func:`finish_piece`."""
    import time

    options = dict(options or {})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    artifact = out_dir / "artifact.bin"
    dynamic = size is None
    real = dict(real_inputs or {})
    inputs = (list(example_inputs) if size is None
              else [real.get(i, v) for i, v in enumerate(static_example_inputs(example_inputs, size))])
    mode: Literal["from_graph", "from_example_inputs"] = "from_graph" if dynamic else "from_example_inputs"
    t0 = t_key = time.perf_counter()
    if key is None:
        key = piece_cache_key(gm, inputs, dynamic, options=options)
    probes = isa_probe_files()
    tmp = Path(tempfile.mkdtemp(prefix="aotc-inductor-", dir=tmp_root))
    try:
        seed_isa_probes(tmp, probes)
        seeded = kernel_pool.seed(pool, tmp)
        phases: dict[str, float] = {"key+setup": time.perf_counter() - t_key}
        timed = _timed_metrics()
        try:
            # cpu_system_info: the AOTAutograd key standalone_compile takes hashes no Triton source
            with inductor_cache_dir(str(tmp)), _grad_mode(gm), _config_patch(options), \
                    in_process_isa_probes(), cpu_system_info():
                t = time.perf_counter()
                with kernel_batch.batched_builds(batch), kernel_checks.guarded_kernel_sources():
                    art = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes=mode)
                phases["inductor"] = time.perf_counter() - t
                t = time.perf_counter()
                art.save(path=str(artifact), format="binary")
                phases["save"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - Inductor raises many kinds
            if is_restart(e):  # Dynamo's own signal to re-trace (a float it made dynamic must be
                raise           # specialized): raised through a backend, Dynamo traces again
            what = "dynamic" if dynamic else f"size {size}"
            raise CompileError(f"Inductor failed to compile piece ({what}) into {out_dir}: "
                               f"{type(e).__name__}: {e}") from e
        for name, spent in _timed_metrics().items():  # inside Inductor's own time, by step
            if spent - timed.get(name, 0.0) > 0:
                phases[f"inductor.{_METRICS[name]}"] = spent - timed.get(name, 0.0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PendingPiece(gm, inputs, size, out_dir, key, tmp, art, seeded, probes, pool, real,
                        phases, t0, batch)


def finish_piece(p: PendingPiece, build_seconds: float = 0.0) -> CompiledPiece:
    """The second half of :func:`compile_piece`, once the batch holding ``p``'s kernels is
    built: the kernel files (the pool's seeded libraries it did not use dropped), the fast-path
    record checked against Inductor's artifact, the kernels copied beside the artifact.
    ``build_seconds``: this piece's share of the batch's compiler run (for its profile).
    The scratch dir stays for the caller to :meth:`~PendingPiece.discard`."""
    import time

    tmp, phases = p.tmp, p.phases
    if build_seconds:
        phases["c++ batch"] = phases.get("c++ batch", 0.0) + build_seconds
    t = time.perf_counter()
    pooled = kernel_pool.prune(tmp, p.seeded)
    files = _kernel_files(tmp)
    # a library built once for several pieces of the batch counts as built by the first only
    pooled |= {rel for rel in files if (tmp / rel).resolve() in p.batch.linked}
    vals = p.inputs if p.size is not None else [
        p.real.get(i, v) for i, v in enumerate(static_example_inputs(p.inputs, _CHECK_TOKENS))]
    kernel_root = p.out_dir / "kernels"
    record = training_path.record_training_fast_path if p.gm.meta.get(_TRAINING) else \
        wrapper.record_fast_path  # a training piece: its forward, backward and AOTAutograd's runtime
    if record is wrapper.record_fast_path:  # the weights it only reads are not copied for the check
        placeholders = sum(n.op == "placeholder" for n in p.gm.graph.nodes)
        read_only = frozenset(range(len(vals))) - written_inputs(p.gm) if placeholders == len(vals) \
            else frozenset()
        note = record(p.art, vals, tmp, files, p.out_dir / "wrapper.json", undefined_outputs(p.gm),
                      read_only=read_only)
    else:
        note = record(p.art, vals, tmp, files, p.out_dir / "wrapper.json", undefined_outputs(p.gm))
    phases["fast-path check"] = time.perf_counter() - t
    t = time.perf_counter()
    for rel in files:
        dst = kernel_root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tmp / rel, dst)
    built = [rel for rel in files if rel not in pooled and rel not in p.probes]
    kernel_pool.add(p.pool, kernel_root, built)
    phases["copy kernels"] = time.perf_counter() - t
    _ours.compiles += 1
    return CompiledPiece(p.out_dir / "artifact.bin", kernel_root, tuple(files), p.size, p.key,
                         time.perf_counter() - p.t0,
                         None if note else p.out_dir / "wrapper.json", note,
                         phases={k: round(v, 4) for k, v in phases.items()},
                         kernels={"built": sum(map(kernel_pool.is_kernel, built)),
                                  "pooled": len(pooled)})
