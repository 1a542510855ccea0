"""Run Inductor's generated CPU wrapper without Inductor: the fast path of the warm start.

An Inductor artifact, once loaded, is a generated Python module (``call(args)``) that allocates
buffers and calls C++ kernels (Python extension modules, one ``.so`` each) and a few ATen
"extern kernels" (``torch.mm(…, out=)``). Loading it through ``CompiledArtifact.load`` imports
Inductor's whole compile stack, re-hashes every kernel source against the compiler's version
and flags, and re-runs the AOTAutograd wrappers: seconds, even for a toy model.

This module keeps that generated module's source *unmodified* and runs it with the four Inductor
names it imports replaced by small stand-ins (:data:`_SHIMS`): ``AsyncCompile`` returns the
shipped kernel library whose source digest matches, ``extern_kernels`` resolves to the public
torch callables recorded at compile time, ``_align`` and the two debug hooks are one-liners.

Only wrappers that need nothing else qualify (CPU, C++ kernels, no Triton, no cpp_wrapper):
:func:`extract` inspects the module with ``ast`` and raises :class:`Unsupported` for anything
unknown, and the compile step checks that the fast path returns exactly (bit for bit) what
Inductor's own loaded artifact returns before recording it. Anything that does not qualify keeps
``CompiledArtifact.load``. Private torch APIs used: ``torch._C._dynamo.guards`` (by the
generated code and for the tensor-data-pointer hook the kernel libraries need) and, at compile
time only, ``torch._inductor.select_algorithm.extern_kernels`` / ``memory_planning._align``.
Tested on torch 2.13.0 (CPU); other versions are covered by the compile-time equality check.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.util
import json
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aotc._torch.kernel_checks import guard_checks
from aotc._torch.scoped_env import scoped_env
from aotc._torch.subclass import flatten_spec, flattened, is_subclass

WRAPPER_FORMAT = 1
# Modules the generated wrapper imports names from, and the names it may import.
_SHIMMED_IMPORTS = {
    "torch._inductor.hooks": {"run_intermediate_hooks"},
    "torch._inductor.utils": {"maybe_profile"},
    "torch._inductor.codegen.memory_planning": {"_align"},
    "torch._inductor.async_compile": {"AsyncCompile"},
    "torch._inductor.select_algorithm": {"extern_kernels"},
}
# Functions the generated module defines for benchmarking only (never called by the loader).
_UNUSED_DEFS = {"get_args", "benchmark_compiled_module"}
_ALIGN_BYTES = 64


class Unsupported(Exception):
    """The wrapper needs more of Inductor than the fast path provides (the reason is the text)."""


@dataclass(frozen=True)
class WrapperCode:
    """A generated wrapper module and what it needs: ``kernels`` maps the digest of each
    C++ kernel's (argtypes, source) to its library (path relative to the kernel root);
    ``externs`` maps each ``extern_kernels.NAME`` used to a public torch path; ``flatten`` maps
    the position of each tensor-subclass input (a torchao weight) to the inner tensors it is
    passed as, in AOTAutograd's order (attribute paths, ``a.b`` for a nested subclass)."""

    source: str
    kernels: dict[str, str] = field(default_factory=dict)
    externs: dict[str, str] = field(default_factory=dict)
    flatten: dict[str, list[str]] = field(default_factory=dict)
    format: int = WRAPPER_FORMAT

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        d = {"format": self.format, "source": self.source, "kernels": self.kernels, "externs": self.externs}
        if self.flatten:
            d["flatten"] = self.flatten
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WrapperCode:
        """Parse :meth:`to_json` output; a malformed record raises ``ValueError``."""
        d = json.loads(data)
        if not isinstance(d, dict) or d.get("format") != WRAPPER_FORMAT:
            raise ValueError(f"wrapper record format {d.get('format') if isinstance(d, dict) else '?'}"
                             f", expected {WRAPPER_FORMAT}")
        return cls(str(d["source"]), dict(d["kernels"]), dict(d["externs"]),
                   {str(k): [str(a) for a in v] for k, v in dict(d.get("flatten") or {}).items()})


def _kernel_digest(argtypes: Sequence[str], source: str) -> str:
    return hashlib.sha256(json.dumps([list(argtypes), source]).encode()).hexdigest()


# ---------------------------------------------------------------------------------- compile time
def _check_ast(source: str) -> list[str]:
    """Raise Unsupported unless every Inductor import is shimmed and nothing else reaches into
    ``torch._inductor`` / ``torch._dynamo``; return the ``extern_kernels`` names used."""
    tree = ast.parse(source)
    externs: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name in _UNUSED_DEFS:
            continue
        if isinstance(stmt, ast.If) and _is_main_guard(stmt.test):  # benchmark entry point
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith(("torch._inductor", "torch._dynamo")):
                    allowed = _SHIMMED_IMPORTS.get(node.module, set())
                    bad = [a.name for a in node.names if a.name not in allowed]
                    if bad:
                        raise Unsupported(f"imports {', '.join(bad)} from {node.module}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(("torch._inductor", "torch._dynamo", "triton")):
                        raise Unsupported(f"imports {a.name}")
            elif isinstance(node, ast.Attribute):
                if (isinstance(node.value, ast.Name) and node.value.id == "torch"
                        and node.attr in ("_inductor", "_dynamo")):
                    raise Unsupported(f"uses torch.{node.attr} at line {node.lineno}")
                if isinstance(node.value, ast.Name) and node.value.id == "extern_kernels":
                    externs.add(node.attr)
                if (isinstance(node.value, ast.Name) and node.value.id == "async_compile"
                        and node.attr not in ("cpp_pybinding", "wait")):
                    raise Unsupported(f"async_compile.{node.attr} (only C++ kernels are supported)")
    return sorted(externs)


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (never run: the module is exec-ed under another name)."""
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _public_path(obj: Any, name: str) -> str:
    """A dotted path under ``torch`` that resolves to ``obj``, or Unsupported."""
    if getattr(torch, name, None) is obj:
        return f"torch.{name}"
    if isinstance(obj, torch._ops.OpOverload):
        return f"torch.ops.{obj.namespace}.{obj._opname}.{obj._overloadname}"
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return f"torch.ops.{obj._qualified_op_name.replace('::', '.')}"
    raise Unsupported(f"extern kernel {name} ({obj!r}) is not a public torch callable")


def _resolve(path: str) -> Any:
    obj: Any = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _source_files(cache_dir: Path) -> list[Path]:
    """The generated wrapper modules in a compile's Inductor cache dir."""
    found = []
    for p in sorted(cache_dir.rglob("*.py")):
        if p.relative_to(cache_dir).parts[0] in ("fxgraph", "aotautograd", "locks", "triton"):
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if "def call(" in text or "call = runner.call" in text:
            found.append(p)
    return found


def extract(cache_dir: Path, kernel_files: Sequence[str], source: str | None = None) -> WrapperCode:
    """The fast-path record of the one piece compiled into ``cache_dir`` (compile time).

    ``kernel_files``: the kernel libraries found there (relative paths). ``source``: the
    generated module's text when the dir holds several (a training piece's forward and
    backward); else the dir's one module. Raises :class:`Unsupported` when the wrapper needs
    more than the shims provide.
    """
    if source is None:
        sources = _source_files(cache_dir)
        if len(sources) != 1:
            raise Unsupported(f"expected one generated wrapper module, found {len(sources)}")
        source = sources[0].read_text(encoding="utf-8")
    extern_names = _check_ast(source)
    from torch._inductor.codegen.memory_planning import _align
    from torch._inductor.select_algorithm import extern_kernels

    if any(_align(n) != _shim_align(n) for n in range(0, 4097, 7)):
        raise Unsupported("Inductor's buffer alignment differs from the shim's")
    externs = {n: _public_path(getattr(extern_kernels, n), n) for n in extern_names}
    calls: list[tuple[list[str], str]] = []
    def record(argtypes: Sequence[str], src: str) -> Any:
        calls.append((list(argtypes), src))
        return _never

    _exec(source, _shims(record, externs))
    cpp = {rel: (cache_dir / rel).with_suffix(".cpp") for rel in kernel_files if rel.endswith(".so")}
    texts = {rel: p.read_text(encoding="utf-8", errors="replace") for rel, p in cpp.items() if p.is_file()}
    kernels: dict[str, str] = {}
    for argtypes, src in calls:
        built = guard_checks(src)  # the source the library was built from (kernel_checks)
        matches = [rel for rel, text in texts.items() if built in text and "PyInit_kernel" in text]
        if len(matches) != 1:
            raise Unsupported(f"{len(matches)} kernel libraries match one kernel's source")
        kernels[_kernel_digest(argtypes, src)] = matches[0]
    return WrapperCode(source, kernels, externs)


def _never(*args: Any) -> None:
    raise Unsupported("a kernel was called while extracting the wrapper")


# ------------------------------------------------------------------------------------ load time
def _shim_align(nbytes: int) -> int:
    return (nbytes + _ALIGN_BYTES - 1) & -_ALIGN_BYTES


def _maybe_profile(*args: Any, **kwargs: Any) -> Any:
    import contextlib

    return contextlib.nullcontext()


def _shims(kernel: Callable[[Sequence[str], str], Any], externs: dict[str, str]) -> dict[str, Any]:
    class AsyncCompile:
        def cpp_pybinding(self, argtypes: Sequence[str], source: str, *rest: Any, **kw: Any) -> Any:
            if rest or kw:
                raise Unsupported("cpp_pybinding with extra arguments")
            return kernel(argtypes, source)

        def wait(self, scope: Any) -> None:
            return None

    namespace = types.SimpleNamespace(**{n: _resolve(p) for n, p in externs.items()})
    return {
        "torch._inductor.hooks": {"run_intermediate_hooks": lambda *a, **k: None},
        "torch._inductor.utils": {"maybe_profile": _maybe_profile},
        "torch._inductor.codegen.memory_planning": {"_align": _shim_align},
        "torch._inductor.async_compile": {"AsyncCompile": AsyncCompile},
        "torch._inductor.select_algorithm": {"extern_kernels": namespace},
    }


def _exec(source: str, shims: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Execute the generated module with ``from <shimmed module> import …`` answered by shims."""
    real_import = builtins.__import__

    def shim_import(name: str, globals: Any = None, locals: Any = None,
                    fromlist: Sequence[str] = (), level: int = 0) -> Any:
        if level == 0 and name in shims:
            return types.SimpleNamespace(**shims[name])
        return real_import(name, globals, locals, fromlist, level)

    scope: dict[str, Any] = {"__name__": "aotc_wrapper",
                             "__builtins__": {**vars(builtins), "__import__": shim_import}}
    exec(compile(source, "<inductor wrapper>", "exec"), scope)  # noqa: S102 - verified artifact
    return scope


_DATA_PTR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def _load_kernel_library(path: Path, digest: str) -> Callable[..., Any]:
    """Import one kernel library (a Python extension whose init function is ``PyInit_kernel``)."""
    hook = getattr(torch._C._dynamo.guards, "_torchinductor_pyobject_tensor_data_ptr", None)
    spec = importlib.util.spec_from_file_location(f"aotc_k{digest[:20]}.kernel", str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import kernel library {path}")
    # the library reads the hook's address from the environment once, in its init function
    # (PyInit runs when the module object is created)
    with scoped_env(**({_DATA_PTR_ENV: str(hook)} if hook is not None else {})):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    kernel: Callable[..., Any] = module.kernel
    return kernel


def load_call(code: WrapperCode, kernel_root: Path) -> Callable[[list[Any]], Any]:
    """The generated module's own ``call(args)`` over the kernel libraries under
    ``kernel_root``: it takes the argument *list* (and empties it, as Inductor's callers expect)."""
    kernel_root = Path(kernel_root)

    def kernel(argtypes: Sequence[str], source: str) -> Callable[..., Any]:
        digest = _kernel_digest(argtypes, source)
        rel = code.kernels.get(digest)
        if rel is None:
            raise ImportError("the wrapper asks for a kernel that was not recorded at compile time")
        return _load_kernel_library(kernel_root / rel, digest)

    call: Callable[[list[Any]], Any] = _exec(code.source, _shims(kernel, code.externs))["call"]
    return call


def load(code: WrapperCode, kernel_root: Path) -> Callable[..., list[torch.Tensor]]:
    """A callable running ``code`` over the kernel libraries under ``kernel_root``; it takes the
    piece's arguments and returns its outputs as a list (like ``inductor.load_piece``)."""
    call = load_call(code, kernel_root)
    spec = {int(i): [p.split(".") for p in paths] for i, paths in code.flatten.items()}

    def run(*args: Any) -> list[torch.Tensor]:
        out = call(flattened(args, spec) if spec else list(args))
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return run


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors of one shape hold the same bit pattern in every element: a NaN only
    equals a NaN of the same bits (never 0), ±inf only ±inf (never the largest float), -0.0 is
    not 0.0. A floating, complex or bool tensor is compared as the integers of its width (made
    contiguous first; 0-dim included); a tensor subclass by its inner tensors."""
    if x.dtype != y.dtype or x.shape != y.shape or (is_subclass(x) or is_subclass(y)) and type(x) is not type(y):
        return False
    if is_subclass(x):
        attrs, ctx = x.__tensor_flatten__()  # type: ignore[attr-defined]  # is_subclass checked it
        same_layout = y.__tensor_flatten__() == (attrs, ctx)  # type: ignore[attr-defined]  # the same subclass
        return same_layout and all(same_bits(getattr(x, n), getattr(y, n)) for n in attrs)
    x, y = x.detach().resolve_conj().resolve_neg(), y.detach().resolve_conj().resolve_neg()
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    ints = _INT_OF_WIDTH.get(x.element_size())
    if ints is not None and (x.dtype.is_floating_point or x.dtype == torch.bool):
        x, y = x.contiguous().view(ints), y.contiguous().view(ints)
    return bool(torch.equal(x, y))


def same_outputs(a: Sequence[Any], b: Sequence[Any], undefined: frozenset[int] = frozenset()) -> bool:
    """True when two output lists are identical: shapes, strides, dtypes and every bit
    (:func:`same_bits`). Outputs at ``undefined`` positions (allocated by the piece but written by a later piece,
    e.g. an out-variant attention's ``output``) are compared by shape, stride and dtype only:
    their contents are whatever the allocator handed out."""
    if len(a) != len(b):
        return False
    for i, (x, y) in enumerate(zip(a, b)):
        if x is y:  # one object on both sides (a subclass weight, passed as it is)
            continue
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype:
            return False
        if i not in undefined and not same_bits(x, y):
            return False
    return True


# a read-only input this large is read where it is, not copied for a check (module doc of _shared)
SHARED_BYTES = 1 << 20


def _shared(v: Any, i: int, read_only: frozenset[int]) -> bool:
    """Whether input ``i`` is passed to a check as it is: not a tensor, a subclass (a weight),
    or an input the piece only reads (``read_only``: :func:`aotc._torch.ops.written_inputs`'s
    complement) that is a parameter or at least ``SHARED_BYTES`` big — a weight, whatever
    wrapper it comes in (the manifest's capture hands the pieces plain tensors). Copied twice,
    at 0.5B the embedding alone (545 MB) took a cold compile to 1.3x eager's memory; a small
    read-only input (an activation, a mask) still gets random values, so that the check does
    not compare two runs on zeros."""
    if not isinstance(v, torch.Tensor) or is_subclass(v):
        return True
    return i in read_only and (isinstance(v, torch.nn.Parameter)
                               or v.numel() * v.element_size() >= SHARED_BYTES)


def _clone(values: Sequence[Any], read_only: frozenset[int] = frozenset()) -> list[Any]:
    return [v if _shared(v, i, read_only) else v.clone() for i, v in enumerate(values)]


def check_values(inputs: Sequence[Any], read_only: frozenset[int] = frozenset()) -> list[Any]:
    """Fresh copies of a piece's inputs for a check run: floating tensors random (seeded), every
    other tensor copied as it is. Never the caller's own tensors: a piece may write its inputs in
    place (a static KV cache's write position, ``cumulative_length.add_(1)``), and a check that
    ran on the real ones would move a live model's state forward (transformers' ``generate()``
    then wrote past its cache and a kernel's bounds check aborted the process) — except the
    parameters at positions in ``read_only`` (never written by the piece: :func:`_shared`),
    read where they are."""
    gen = torch.Generator().manual_seed(0)
    out: list[Any] = []
    for i, v in enumerate(inputs):
        if _shared(v, i, read_only):
            out.append(v)
            continue
        fresh = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        if v.dtype.is_floating_point:
            fresh.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
        else:
            try:
                fresh.copy_(v)
            except RuntimeError:  # strides that overlap (an expanded view): a dense copy
                fresh = v.clone()
        out.append(fresh)
    return out


def record_fast_path(artifact: Callable[..., Any], inputs: Sequence[Any], cache_dir: Path,
                     kernel_files: Sequence[str], out_file: Path,
                     undefined: frozenset[int] = frozenset(), read_only: frozenset[int] = frozenset()) -> str:
    """Extract the fast-path record of a just-compiled piece, check it against ``artifact``
    (Inductor's own callable) on ``inputs`` with random values, and write it to ``out_file``.

    Each side runs on its own copy of the inputs, and the inputs it mutates (a KV cache
    written in place) must end up identical too. ``undefined``: output positions whose
    contents the piece never defines (see :func:`same_outputs`). ``read_only``: input
    positions the piece never writes, whose parameters both sides read as they are
    (:func:`check_values`).
    Returns "" when recorded, else the reason the piece keeps ``CompiledArtifact.load``.
    """
    try:
        code = extract(cache_dir, kernel_files)
        try:
            spec = flatten_spec(inputs)
        except ValueError as e:
            raise Unsupported(str(e)) from e
        code = WrapperCode(code.source, code.kernels, code.externs, spec)
        fast = load(code, cache_dir)
        values = check_values(inputs, read_only)
        mine, theirs = _clone(values, read_only), values  # one copy: the values are fresh for this check
        with torch.no_grad():
            want = artifact(*theirs)
            want = list(want) if isinstance(want, (list, tuple)) else [want]
            got = fast(*mine)
    except Unsupported as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure means: keep Inductor's loader
        return f"{type(e).__name__}: {e}"
    if not same_outputs(want, got, undefined):
        return "outputs differ from Inductor's artifact"
    if not same_outputs(theirs, mine):
        return "the inputs it mutates differ from what Inductor's artifact leaves in them"
    out_file.write_bytes(code.to_json())
    return ""
