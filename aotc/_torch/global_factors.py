"""The key's ``global`` group: the process-wide torch settings that change what Inductor
generates, taken from Inductor's own FX graph cache key (``FxGraphHashDetails`` in
``torch/_inductor/codecache.py``) so that a setting torch starts hashing is keyed by aotc with no
change here.

An ``FxGraphHashDetails`` made for an empty graph lists the fields torch hashes in this process
(:func:`hash_detail_fields`; it imports Inductor, so the list is remembered per toolchain in the
store's toolchain memo). Each field is one of:

* keyed elsewhere in aotc's key (:data:`KEYED_ELSEWHERE`: the graph, Inductor's settings, the
  toolchain), or left out on purpose (:data:`DENIED`), each with its reason;
* read here by :data:`READERS` without importing Inductor (the warm start must not), spelled by
  setting name so ``aotc explain`` names the one that differs;
* any other field — one a newer torch added — read from a real ``FxGraphHashDetails`` (importing
  Inductor) and keyed as it is: a new global factor enters the key unasked. A value with no
  stable spelling is a ``TypeError``, never skipped.

Beside torch's own fields, :data:`ALWAYS` names those keyed even where an older torch does not
hash them (the default dtype, from torch 2.12), and :data:`EXTRA_READERS` keys settings Inductor reads while generating
code that its cache key leaves out: oneDNN's fp32 precision (``pad_mm`` on CPU reads
``torch.backends.mkldnn.fp32_precision``; ``set_float32_matmul_precision("medium")`` sets the
oneDNN matmul precision to bf16) and cuDNN's TF32 flags (Inductor's Triton conv templates bake
``ALLOW_TF32`` from them), and the root ``torch.backends.fp32_precision`` they inherit from.
``tests/test_global_factors.py`` reads every ``self.X =`` of
``FxGraphHashDetails.__init__`` and fails when one is neither read, keyed elsewhere nor denied.

Tested on torch 2.13 (CPU); written for 2.11–2.13 (fields feature-checked).
"""

from __future__ import annotations

import contextlib
import enum
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["ALWAYS", "DENIED", "EXTRA_READERS", "KEYED_ELSEWHERE", "READERS", "cpu_system_info", "global_factors",
           "hash_detail_fields"]

_GRAPH = "the graph itself: aotc's graph key (backend) or the manifest and traced code (manifest)"
_INDUCTOR = "Inductor's settings: the key's inductor.values (aotc._torch.inductor_facts.config_values)"

# FxGraphHashDetails fields aotc keys in another group of its key.
KEYED_ELSEWHERE: dict[str, str] = {
    "gm": _GRAPH,
    "example_inputs": _GRAPH + "; inputs' dtypes, shapes and strides",
    "user_defined_triton_source": _GRAPH + " (a user Triton kernel's source is traced code)",
    "fx_kwargs": "compile_fx's arguments: fixed by aotc's compile (inference, the piece's role)",
    "inputs_to_check": "which inputs compile_fx aligns: derived from the graph's inputs",
    "inductor_config": _INDUCTOR,
    "inductor_config_comms": _INDUCTOR + " (config_comms.*)",
    "provenance_tracking_level": _INDUCTOR + " (trace.provenance_tracking_level)",
    "pre_grad_custom_pass": _INDUCTOR + " (by the pass's uuid())",
    "post_grad_custom_pre_pass": _INDUCTOR + " (by the pass's uuid())",
    "post_grad_custom_post_pass": _INDUCTOR + " (by the pass's uuid())",
    "joint_custom_pre_pass": _INDUCTOR + " (by the pass's uuid())",
    "joint_custom_post_pass": _INDUCTOR + " (by the pass's uuid())",
    "_pre_fusion_custom_pass": _INDUCTOR + " (by the pass's uuid())",
    "_fuse_ddp_communication_passes": _INDUCTOR,
    "_post_fusion_custom_pass": _INDUCTOR,
    "_custom_partitioner_fn": _INDUCTOR + " (custom_partitioner_fn)",
    "torch_version": "the toolchain's torch_key",
    "system_info": "the toolchain: device, GPU, CUDA/HIP and Triton versions, compiler",
    "cpp_runtime_thread_count": "the key's inductor.cpu_threads (the thread count C++ kernels are written for)",
    "default_cuda_device_index": "the graph's device (a graph with no tensor input on an accelerator)",
}

# FxGraphHashDetails fields aotc leaves out on purpose.
DENIED: dict[str, str] = {
    "cudagraph_override": "CUDA graphs are applied by aotc's loader, never by Inductor's compile",
    "cudagraph_annotation": "CUDA graphs are applied by aotc's loader, never by Inductor's compile",
    "precompile_enabled": "functorch's bundled_autograd_cache: aotc compiles through standalone_compile, which "
                          "sets it itself (torch's AOT compile patches it around the backend call)",
    "var_to_hint_override": "a graph's own symbol hints (mark_dynamic's hint_override) from the compile's "
                            "shape env, empty outside one; aotc's graph key records the symbols and ranges",
}


def _deterministic() -> dict[str, Any]:
    det = getattr(torch.utils, "deterministic", None)
    return {"torch.are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled(),
            "torch.is_deterministic_algorithms_warn_only_enabled":
                torch.is_deterministic_algorithms_warn_only_enabled(),
            "torch.utils.deterministic.fill_uninitialized_memory":
                getattr(det, "fill_uninitialized_memory", None)}


# torch's fp32 precision settings (the new API; the legacy ``allow_tf32`` getters and
# ``get_float32_matmul_precision`` raise when a process mixed both APIs, so they are never read):
# each node inherits its parent's when it says "none"; the root's "none" is IEEE.
_PRECISION_PARENT: dict[str, str | None] = {
    "": None, "cuda.matmul": "", "mkldnn": "", "mkldnn.matmul": "mkldnn", "mkldnn.conv": "mkldnn",
    "cudnn": "", "cudnn.conv": "cudnn",
}


def _raw_precision(node: str) -> str | None:
    obj: Any = torch.backends
    for part in filter(None, node.split(".")):
        obj = getattr(obj, part, None)
    value = getattr(obj, "fp32_precision", None)
    return None if value is None else str(value)


def _effective_precision(node: str) -> str:
    raw = _raw_precision(node)
    if raw not in (None, "none"):
        return str(raw)
    parent = _PRECISION_PARENT.get(node)
    return "ieee" if parent is None else _effective_precision(parent)


def _precision(node: str) -> str | None:
    """``torch.backends.<node>.fp32_precision`` as keyed: as set, except that "none" whose parents
    resolve to IEEE is spelled "ieee" — Inductor's codegen tests ``== "tf32"`` and aten runs IEEE
    for both, so a server that calls ``set_float32_matmul_precision("highest")`` (vLLM's workers
    do) keeps the default's key. A "none" under a TF32 parent stays "none" (Inductor reads the
    node, aten the parent: a key of its own)."""
    raw = _raw_precision(node)
    if raw == "none" and _effective_precision(node) == "ieee":
        return "ieee"
    return raw


def _cuda_matmul() -> dict[str, Any]:
    m = torch.backends.cuda.matmul
    return {"torch.backends.cuda.matmul.fp32_precision": _precision("cuda.matmul"),
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
                m.allow_fp16_reduced_precision_reduction,
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
                m.allow_bf16_reduced_precision_reduction}


def _backend_precisions(*nodes: str) -> dict[str, Any]:
    return {".".join(filter(None, ("torch.backends", node, "fp32_precision"))): _precision(node) for node in nodes}


def _mkldnn() -> dict[str, Any]:
    return _backend_precisions("mkldnn", "mkldnn.matmul", "mkldnn.conv")


def _cudnn() -> dict[str, Any]:
    return _backend_precisions("cudnn", "cudnn.conv")


def _backend_registry(name: str) -> Any:
    """Inductor's registry of out-of-tree device backends' passes / codegen configs, as the
    uuids and portable configs of those set. A process that has not imported Inductor's codegen
    has registered none: it is read as empty then, without importing it (the warm start)."""
    import sys

    common = sys.modules.get("torch._inductor.codegen.common")
    registry = getattr(common, name, None) or {}
    if name == "custom_backend_passes":
        return sorted(_canonical(p.uuid(), name) for p in registry.values() if p is not None)
    return {dev: cfg.save_config_portable(ignore_private_configs=False)
            for dev, cfg in sorted(registry.items()) if cfg is not None}


# torch's fields read here, each as the settings it is made of (torch reads them the same way).
READERS: dict[str, Callable[[], Any]] = {
    "deterministic_algorithms_settings": _deterministic,
    "cuda_matmul_settings": _cuda_matmul,
    "default_dtype": lambda: str(torch.get_default_dtype()),
    "cache_key_tag": lambda: _compiler_config("cache_key_tag"),
    "custom_backend_passes": lambda: _backend_registry("custom_backend_passes"),
    "custom_backend_codegen_configs": lambda: _backend_registry("custom_backend_codegen_configs"),
}

# torch's fields aotc keys whether or not this torch hashes them: torch 2.11's key leaves the
# default dtype out (2.12 added it), while its lowerings read it (a factory op with no dtype)
ALWAYS = ("default_dtype",)

# Settings Inductor's codegen reads that its own cache key does not hash (module doc).
EXTRA_READERS: dict[str, Callable[[], Any]] = {"mkldnn": _mkldnn, "cudnn": _cudnn,
                                               "fp32_precision": lambda: _backend_precisions("")}


def _compiler_config(name: str) -> Any:
    config = getattr(torch, "compiler", None)
    return getattr(getattr(config, "config", None), name, None)


def hash_detail_fields() -> list[str]:
    """The fields of ``FxGraphHashDetails`` for an empty graph in this process, sorted (imports
    Inductor's code cache: callers remember the list per toolchain)."""
    return sorted(vars(_details()))


def _details() -> Any:
    """An ``FxGraphHashDetails`` for an empty graph (its ``system_info`` as torch computes it, but
    without hashing Triton's source where that hash is thrown away: :func:`cpu_system_info`)."""
    from torch._inductor.codecache import FxGraphHashDetails

    with cpu_system_info():
        return FxGraphHashDetails(None, [], {}, [])


def _system_info_without_triton() -> Any:
    """What torch's ``CacheBase.get_system()`` returns on a machine without CUDA, computed by a
    copy of torch's own function whose ``triton_key`` is a stand-in: there the device query
    fails and torch drops the Triton hash it made (``triton_key()``: Triton's whole source and
    its 500 MB library hashed, 0.35 s in a fresh process). None where CUDA is available (the
    hash is kept there) or torch's function is laid out otherwise (torch 2.11 imports
    ``triton_key`` inside it)."""
    if torch.cuda.is_available():
        return None
    from torch._inductor import codecache

    fn = getattr(getattr(codecache, "CacheBase", None), "get_system", None)
    original: Any = getattr(fn, "__wrapped__", None)
    code = getattr(original, "__code__", None)
    if code is None or "triton_key" not in code.co_names or "triton_key" in code.co_varnames:
        return None
    copied = types.FunctionType(code, {**original.__globals__, "triton_key": lambda: None}, original.__name__,
                                original.__defaults__, original.__closure__)
    return copied()


_SYSTEM: dict[str, Any] = {}


@contextlib.contextmanager
def cpu_system_info() -> Iterator[None]:
    """While in the block, torch's ``CacheBase.get_system()`` answers with
    :func:`_system_info_without_triton` — the very value torch computes on this machine, without
    hashing Triton — where that applies; torch's own elsewhere. Its cache is untouched, and
    another thread asking meanwhile gets the same value. Holds the process scope (a patched
    torch class)."""
    from aotc._torch.scoped_env import process_scope

    if "value" not in _SYSTEM:
        _SYSTEM["value"] = _system_info_without_triton()
    value = _SYSTEM["value"]
    if value is None:
        yield
        return
    from torch._inductor.codecache import CacheBase

    with process_scope():
        original = CacheBase.__dict__["get_system"]
        CacheBase.get_system = staticmethod(lambda: value)  # type: ignore[method-assign,assignment]  # patched for the block, put back after it
        try:
            yield
        finally:
            CacheBase.get_system = original  # type: ignore[method-assign]  # patched for the block, put back after it


def _canonical(value: Any, name: str) -> Any:
    """``value`` as JSON-able data equal in every process, else ``TypeError``."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"torch global setting {name}: non-finite {value!r} has no canonical form")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _canonical(v, f"{name}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    raise TypeError(f"torch global setting {name}: {type(value).__name__} ({value!r:.60}) has no stable "
                    "spelling for aotc's key; add a reader to aotc._torch.global_factors.READERS or deny it")


def global_factors(fields: list[str]) -> dict[str, Any]:
    """The ``global`` key group for this process, now: each of torch's hash-detail ``fields``
    (:func:`hash_detail_fields`) that aotc keys in no other group, plus :data:`ALWAYS` and
    :data:`EXTRA_READERS`.
    Fields this module knows are read without importing Inductor; an unknown one (a newer
    torch's) from a real ``FxGraphHashDetails``."""
    out: dict[str, Any] = {}
    details: Any = None
    for name in fields:
        if name in KEYED_ELSEWHERE or name in DENIED:
            continue
        if name in READERS:
            out[name] = _canonical(READERS[name](), name)
            continue
        if details is None:
            details = _details()
        if hasattr(details, name):
            out[name] = _canonical(getattr(details, name), name)
    for name in ALWAYS:
        if name not in out:
            out[name] = _canonical(READERS[name](), name)
    for name, read in EXTRA_READERS.items():
        out[name] = _canonical(read(), name)
    return out
