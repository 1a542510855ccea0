"""A training piece at a warm start without Inductor: its forward and backward through
:mod:`aotc._torch.wrapper`, joined by AOTAutograd's own runtime (the ``autograd.Function`` that
saves tensors for the backward, detaches, replays input mutations).

Inductor's loader (``CompiledArtifact.load``) rebuilds that runtime too, but gets there through
``torch._inductor.compile_fx`` (a 1.1–1.3 s import measured here, for one ``TypedDict``) and
FxGraphCache's lookups: most of a small training job's warm start. This module records, at
compile time, the two generated modules (as :class:`~aotc._torch.wrapper.WrapperCode`) and the
runtime facts AOTAutograd saved in its cache entry (view/mutation metadata, subclass metadata,
saved-tensor counts, the dispatch wrappers, the sanitized config), and at load builds the runtime
with the same calls AOTAutograd's cache hit makes (``GenericAOTAutogradResult.
_apply_runtime_wrappers``, torch 2.13), with our two callables in place of Inductor's.

A piece is recorded only when its fast runtime returns, bit for bit, what Inductor's artifact
returns — outputs, which outputs carry a ``grad_fn``, every input's gradient, and the inputs the
forward mutates (BatchNorm's running statistics) — on the same random inputs (a tensor-subclass
input, torchao's quantized weight, passed as it is: AOTAutograd's subclass wrapper flattens it)
(:func:`record_training_fast_path`); anything else keeps Inductor's loader. Private torch APIs:
``torch._functorch._aot_autograd.runtime_wrappers`` (and ``aot_autograd_result`` /
``torch._inductor.output_code`` at compile time, to read the entry). Written for torch 2.13,
tested on 2.13.0 (CPU); on other versions (2.11, 2.12) a difference in these APIs shows as a refused
record at compile time, and the piece keeps Inductor's loader.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aotc._torch import wrapper
from aotc._torch.subclass import is_subclass

TRAINING_FORMAT = 1
KIND = "training"


def is_training_record(data: bytes) -> bool:
    """Whether a fast-path record (JSON bytes) is a training piece's (else a plain wrapper's)."""
    try:
        d = json.loads(data)
    except ValueError:
        return False
    return isinstance(d, dict) and d.get("kind") == KIND


# ---------------------------------------------------------------------------------- compile time
def _entry(cache_dir: Path) -> Any:
    """AOTAutograd's cache entry of the one piece compiled into ``cache_dir``."""
    files = [p for p in (cache_dir / "aotautograd").glob("*/*") if p.is_file()]
    if len(files) != 1:
        raise wrapper.Unsupported(f"expected one AOTAutograd cache entry, found {len(files)}")
    return pickle.loads(files[0].read_bytes())  # noqa: S301 - written by this compile


def _graph_source(cache_dir: Path, loadable: Any) -> str:
    """The generated module of one of the entry's graphs (its FxGraphCache entry's source)."""
    key = loadable.fx_graph_cache_info[0]
    files = [p for p in (cache_dir / "fxgraph").glob(f"*/{key}/*") if p.is_file()]
    if len(files) != 1:
        raise wrapper.Unsupported(f"expected one FxGraphCache entry for {key[:12]}…, found {len(files)}")
    graph = pickle.loads(files[0].read_bytes())  # noqa: S301 - written by this compile
    source = getattr(graph, "source_code", None)
    if not isinstance(source, str):
        raise wrapper.Unsupported("the compiled graph keeps no source")
    return source


def _runtime_facts(entry: Any) -> dict[str, Any]:
    bw = entry.compiled_bw
    if bw is None:
        raise wrapper.Unsupported("AOTAutograd compiled no backward")
    if getattr(entry, "guards_expr", None):
        raise wrapper.Unsupported("the entry carries shape guards")
    return {"runtime_metadata": entry.runtime_metadata, "maybe_subclass_meta": entry.maybe_subclass_meta,
            "num_fw_outs_saved_for_bw": entry.num_fw_outs_saved_for_bw,
            "indices_of_inps_to_detach": list(entry.indices_of_inps_to_detach),
            "num_symints_saved_for_bw": bw.num_symints_saved_for_bw_,
            "backward_state_indices": list(bw.backward_state_indices),
            "dispatch_wrappers": list(entry.dispatch_wrappers), "aot_config": entry.sanitized_aot_config}


def _b64(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def extract(cache_dir: Path, kernel_files: Sequence[str]) -> bytes:
    """The training record (JSON bytes) of the one training piece compiled into ``cache_dir``;
    :class:`~aotc._torch.wrapper.Unsupported` when it does not qualify."""
    entry = _entry(cache_dir)
    facts = _runtime_facts(entry)
    fw = wrapper.extract(cache_dir, kernel_files, _graph_source(cache_dir, entry.compiled_fw))
    bw = wrapper.extract(cache_dir, kernel_files, _graph_source(cache_dir, entry.compiled_bw))
    lazy = getattr(entry, "serialized_bw_module", None)
    record = {"format": TRAINING_FORMAT, "kind": KIND,
              "forward": json.loads(fw.to_json()), "backward": json.loads(bw.to_json()),
              "runtime": _b64(facts), "lazy_backward": _b64(lazy) if lazy is not None else None}
    return json.dumps(record, sort_keys=True).encode()


def _grad_values(inputs: Sequence[Any]) -> list[Any]:
    """:func:`~aotc._torch.wrapper.check_values` with each input's ``requires_grad`` kept."""
    out = wrapper.check_values(inputs)
    for v, fresh in zip(inputs, out):
        if isinstance(v, torch.Tensor) and v.requires_grad and isinstance(fresh, torch.Tensor):
            fresh.requires_grad_(True)
    return out


def _copies(values: Sequence[Any]) -> list[Any]:
    return [v.detach().clone().requires_grad_(v.requires_grad)
            if isinstance(v, torch.Tensor) and not is_subclass(v) else v for v in values]


def _forward_backward(fn: Callable[..., Any], values: list[Any]) -> tuple[list[Any], list[bool], list[Any]]:
    """Outputs, which carry a ``grad_fn``, and the inputs' gradients after a backward through
    every differentiable output with seeded random cotangents."""
    with torch.enable_grad():
        res = fn(*values)
    outs = list(res) if isinstance(res, (list, tuple)) else [res]
    flags = [isinstance(o, torch.Tensor) and o.grad_fn is not None for o in outs]
    gen = torch.Generator().manual_seed(1)
    pairs = [(o, torch.randn(o.shape, generator=gen).to(o.dtype)) for o, f in zip(outs, flags) if f]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grads = [v.grad if isinstance(v, torch.Tensor) else None for v in values]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], flags, grads


def _same_grads(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return all((x is None) == (y is None) and (x is None or wrapper.same_bits(x, y)) for x, y in zip(a, b))


def record_training_fast_path(artifact: Callable[..., Any], inputs: Sequence[Any], cache_dir: Path,
                              kernel_files: Sequence[str], out_file: Path,
                              undefined: frozenset[int] = frozenset()) -> str:
    """Write ``out_file`` (the training record) when the fast runtime matches Inductor's
    ``artifact`` bit for bit (module doc); returns "" when recorded, else the reason the
    piece keeps Inductor's loader."""
    try:
        data = extract(cache_dir, kernel_files)
        fast = load(data, cache_dir)
        values = _grad_values(inputs)
        theirs, mine = _copies(values), _copies(values)
        want = _forward_backward(artifact, theirs)
        got = _forward_backward(fast, mine)
    except wrapper.Unsupported as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure means: keep Inductor's loader
        return f"{type(e).__name__}: {e}"
    if not wrapper.same_outputs(want[0], got[0], undefined):
        return "outputs differ from Inductor's artifact"
    if want[1] != got[1]:
        return "the outputs that carry a grad_fn differ from Inductor's artifact's"
    if not _same_grads(want[2], got[2]):
        return "gradients differ from Inductor's artifact's"
    if not wrapper.same_outputs([v.detach() if isinstance(v, torch.Tensor) else v for v in theirs],
                                [v.detach() if isinstance(v, torch.Tensor) else v for v in mine]):
        return "the inputs it mutates differ from what Inductor's artifact leaves in them"
    out_file.write_bytes(data)
    return ""


# ------------------------------------------------------------------------------------ load time
def _boxed(call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def run(args: list[Any]) -> Any:
        return call(args)

    run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's runtime calls it with the list
    return run


def load(data: bytes, kernel_root: Path) -> Callable[..., list[torch.Tensor]]:
    """A training record back as the piece's callable (outputs as a list, with autograd), over
    the kernel libraries under ``kernel_root``. A malformed record raises ``ValueError``."""
    import torch._dynamo  # first: runtime_wrappers imported alone is a circular import (torch 2.13)
    from torch._functorch._aot_autograd import runtime_wrappers as rw
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    d = json.loads(data)
    if not isinstance(d, dict) or d.get("kind") != KIND or d.get("format") != TRAINING_FORMAT:
        raise ValueError(f"training record format {d.get('format') if isinstance(d, dict) else '?'}, "
                         f"expected {TRAINING_FORMAT}")
    fw_code = wrapper.WrapperCode.from_json(json.dumps(d["forward"]).encode())
    bw_code = wrapper.WrapperCode.from_json(json.dumps(d["backward"]).encode())
    facts = pickle.loads(base64.b64decode(d["runtime"]))  # noqa: S301 - a trusted entry's record
    lazy_blob = d.get("lazy_backward")
    fw = _boxed(wrapper.load_call(fw_code, kernel_root))
    bw = torch._dynamo.disable(_boxed(wrapper.load_call(bw_code, kernel_root)),
                               reason="do not trace generated backwards pass")
    meta, sub, cfg = facts["runtime_metadata"], facts["maybe_subclass_meta"], facts["aot_config"]
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        fw = rw.AOTDispatchSubclassWrapper(trace_joint=True, fw_only=None, maybe_subclass_meta=sub,
                                           num_fw_outs_saved_for_bw=facts["num_fw_outs_saved_for_bw"],
                                           ).post_compile(fw, cfg, runtime_metadata=meta)
        fw = rw.FunctionalizedRngRuntimeWrapper(return_new_outs=False).post_compile(
            fw, cfg, runtime_metadata=meta)
        fw._boxed_call = True  # type: ignore[attr-defined]  # as AOTAutograd's cache hit sets it
        lazy = None
        if lazy_blob is not None:
            def bw_module() -> Any:  # only compiled autograd asks for it: unpickled then
                return pickle.loads(base64.b64decode(lazy_blob)).deserialize()  # noqa: S301

            lazy = rw.CachedAutogradLazyBackwardCompileInfo(bw_module)
        spec = rw.AOTDispatchAutogradCompileSpec(
            compiled_fw_func=fw, compiled_bw_func=bw, maybe_subclass_meta=sub,
            num_symints_saved_for_bw=facts["num_symints_saved_for_bw"],
            backward_state_indices=facts["backward_state_indices"],
            disable_amp=torch._C._is_any_autocast_enabled(),
            indices_of_inps_to_detach=facts["indices_of_inps_to_detach"], lazy_backward_info=lazy,
            bw_compiler=None, aot_config=cfg, fw_metadata=meta, try_save_cache_entry=None)
        compiled = rw.AOTDispatchAutograd.post_compile(spec)
        compiled, _ = rw.post_compile(facts["dispatch_wrappers"], compiled, cfg, runtime_metadata=meta)

    def run(*args: Any) -> list[torch.Tensor]:
        out = compiled(list(args))
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return run
