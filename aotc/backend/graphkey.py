"""The key of a graph Dynamo hands the backend: a canonical form of the graph that is the same in
every process, from any working directory and on any machine with the same toolchain.

What goes in, per placeholder: its kind (tensor, size symbol, opaque value such as vLLM's
``LayerName``, plain scalar), a tensor's dtype, shape and strides with the size symbols renamed
``S0, S1, …`` in order of first appearance, its device and whether it is a parameter; per node:
its kind, a stable name of its target (``ns::op.overload``, ``module.qualname``, a method name),
its arguments with nodes as ``%index`` and constants written out; the schema of every custom op
the graph calls (an op whose signature changes is a new key); a digest of every tensor constant
and the canonical form of every nested graph (``get_attr``). Left out on purpose: placeholder and
node names (Dynamo derives them from module paths and counters), source locations and stack
traces (they hold install paths), the values of opaque inputs (passed through at call time) and
the weights' values (graph inputs, bound at call time).

A constant with no stable spelling (its ``repr`` holds an address) is an error, never a guess:
a key that differs from run to run would miss forever, one that ignores a value would hit stale.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from aotc._torch import dynamo
from aotc._torch.ops import op_name, op_schema, stable_name
from aotc._torch.subclass import is_subclass
from aotc.errors import BackendError

__all__ = ["global_state", "graph_device", "graph_factors", "graph_signature", "static_graph"]

_BUILTIN_NAMESPACES = {"aten", "prims", "higher_order", "_c10d_functional", "c10d_functional"}


class _Canon:
    """One graph's canonical writer (symbol names are shared by the placeholders and nodes)."""

    def __init__(self) -> None:
        self.symbols: dict[Any, str] = {}
        self.ranges: dict[str, Any] = {}  # canonical symbol -> the range the shape env proved
        self.custom_ops: dict[str, str] = {}
        self.functions: dict[str, str] = {}  # Python callables traced into the artifact -> digest

    def size(self, s: Any) -> Any:
        if not isinstance(s, torch.SymInt):
            return int(s)
        import sympy

        expr = dynamo.symbol_key(s)
        mapping = {}
        for f in sorted(expr.free_symbols, key=lambda x: str(x)):
            name = self.symbols.setdefault(f, f"S{len(self.symbols)}")
            mapping[f] = sympy.Symbol(name, integer=True)
            if name not in self.ranges:  # Inductor uses the bounds (32-bit indexing, checks)
                vr = dynamo.free_symbol_range(s, f)
                self.ranges[name] = None if vr is None else list(vr)
        return str(expr.xreplace(mapping))

    def placeholder(self, node: torch.fx.Node, example: Any) -> dict[str, Any]:
        val = node.meta.get("example_value", example)
        if isinstance(val, torch.SymInt):
            return {"kind": "symbol", "expr": self.size(val)}
        if isinstance(val, torch.Tensor):
            out = self.tensor(val, node.name)
            out["param"] = isinstance(example, torch.nn.Parameter)
            if isinstance(example, torch.Tensor) and type(example) not in (torch.Tensor, torch.nn.Parameter):
                out["subclass"] = self.subclass(example, node.name, 0)  # (raises if it cannot flatten)
            return out
        if isinstance(example, (bool, int, float)) and not isinstance(example, torch.SymInt):
            return {"kind": "scalar", "type": type(example).__name__}
        if isinstance(val, (torch.SymFloat, torch.SymBool)):
            return {"kind": "symbol", "type": type(val).__name__, "expr": str(dynamo.symbol_key(val))}
        t = type(example)
        return {"kind": "opaque", "type": f"{t.__module__}.{t.__qualname__}"}

    def tensor(self, val: torch.Tensor, where: str) -> dict[str, Any]:
        """A tensor's metadata: dtype, shape and strides (size symbols canonical), device."""
        return {"kind": "tensor", "dtype": str(val.dtype).removeprefix("torch."),
                "shape": [self.size(d) for d in val.shape],
                "stride": [self.size(d) for d in val.stride()],
                "device": str(val.device), "requires_grad": bool(val.requires_grad)}

    def subclass(self, t: torch.Tensor, where: str, depth: int) -> dict[str, Any]:
        """A tensor subclass input (torchao's quantized weights): its type, the context its
        ``__tensor_flatten__`` returns (block sizes, dtypes, flags: they shape the code AOTAutograd
        traces through it) and each inner tensor's metadata, nested subclasses spelled out in
        turn. The inner tensors' values are inputs, bound at call time, as a weight's are."""
        kind = type(t)
        name = f"{kind.__module__}.{kind.__qualname__}"
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None or depth > 4:
            raise BackendError(f"graph input {where!r} is a tensor subclass ({name}) that does not "
                               "flatten (no __tensor_flatten__): not supported by the aotc backend")
        attrs, ctx = flatten()
        inner: dict[str, Any] = {}
        for attr in attrs:
            value = getattr(t, attr)
            if not isinstance(value, torch.Tensor):
                raise BackendError(f"graph input {where!r} ({name}): inner value {attr!r} is not a tensor")
            inner[attr] = self.tensor(value, where)
            if is_subclass(value):
                inner[attr]["subclass"] = self.subclass(value, where, depth + 1)
        # the code AOTAutograd traces through it (its __torch_dispatch__) is the library's: its
        # version (or its module's source) counts
        return {"type": name, "ctx": self.const(ctx, where), "inner": inner,
                "code": _module_fingerprint(kind.__module__)}

    def target(self, node: torch.fx.Node) -> str:
        t = node.target
        if node.op in ("call_method", "call_module", "get_attr", "output"):
            return str(t) if node.op == "call_method" else ""
        name = op_name(t)
        if name is not None and name.startswith("higher_order::triton_kernel"):
            raise BackendError(f"graph node {node.name!r} calls a user Triton kernel; its source is "
                               "not keyed yet: not supported by the aotc backend")
        if name is not None:
            ns = name.split("::", 1)[0]
            if ns not in _BUILTIN_NAMESPACES and name not in self.custom_ops:
                self.custom_ops[name] = op_schema(t)
            return name
        if t is operator.getitem:
            return "operator.getitem"
        full = stable_name(t)
        if full is None or "<" in full:  # a stored artifact names a function it calls by reference
            raise BackendError(f"graph node {node.name!r} calls {t!r}, which has no stable name; "
                               "the graph cannot be keyed (make it a torch op or a module function)")
        fn = t.func if isinstance(t, functools.partial) else t
        if isinstance(fn, types.FunctionType) and not full.startswith(("torch.", "operator.", "math.")):
            # traced into the artifact: its body and closure count
            digest = self.function_digest(fn, node.name)
            self.functions[full] = digest
            full = f"{full}@{digest[:16]}"
        if isinstance(t, functools.partial):
            full += json.dumps(self.const([list(t.args), dict(t.keywords)], node.name), sort_keys=True)
        return full

    def function_digest(self, fn: types.FunctionType, where: str, depth: int = 0) -> str:
        """sha256 of a Python function's code (bytecode, constants, names; nested code objects
        too — two lambdas on one line differ), its default arguments, the values its closure
        captured and the globals it reads (``boolean_dispatch``'s two functions, a factory's
        parameters, a module constant): what changes them changes the traced graph. A
        function among those values is digested in turn (``functools.wraps`` wrappers unwrapped),
        a module by name."""
        import inspect

        fn = inspect.unwrap(fn)
        seen = {n: fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__}
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append("<empty>")
        values = [self.bound(v, where, depth) for v in
                  [*cells, fn.__defaults__, fn.__kwdefaults__, *[seen[n] for n in sorted(seen)]]]
        h = hashlib.sha256(_code_text(fn.__code__).encode())
        h.update(json.dumps([values, sorted(seen)], sort_keys=True).encode())
        return h.hexdigest()

    def bound(self, value: Any, where: str, depth: int) -> Any:
        """A value a function binds (a closure cell, a default, a global it reads), spelled for
        its digest; a callable or module it refers to by its stable name (a user function's
        body as well, 3 levels deep)."""
        if isinstance(value, types.ModuleType):
            return {"$module": value.__name__}
        if isinstance(value, types.FunctionType) and depth < 3 \
                and not str(value.__module__).startswith(("torch.", "torch")):
            return {"$fn": stable_name(value), "digest": self.function_digest(value, where, depth + 1)}
        if callable(value) and not isinstance(value, (type, torch.Tensor, torch.nn.Module)):
            name = stable_name(value)
            if name is not None:
                return {"$callable": name}
        return self.const(value, where)  # (an object spelled by its address: unkeyable)

    def const(self, a: Any, where: str) -> Any:
        if a is None or isinstance(a, (bool, int, str)):
            return a
        if isinstance(a, float):
            return repr(a) if not math.isfinite(a) else a
        if isinstance(a, (tuple, list)):
            return [type(a).__name__, *[self.const(x, where) for x in a]]
        if isinstance(a, dict):
            return {"$dict": [[str(k), self.const(v, where)] for k, v in a.items()]}
        if isinstance(a, slice):
            return {"$slice": [self.const(a.start, where), self.const(a.stop, where),
                               self.const(a.step, where)]}
        if isinstance(a, torch.SymInt):
            return {"$sym": self.size(a)}
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return {"$" + type(a).__name__: str(a)}
        if isinstance(a, torch.Size):
            return {"$size": [self.size(d) for d in a]}
        if isinstance(a, type):
            return {"$type": f"{a.__module__}.{a.__qualname__}"}
        if isinstance(a, torch.Tensor):
            return {"$tensor": _tensor_digest(a)}
        text = repr(a)
        if " at 0x" in text:
            raise BackendError(f"graph node {where!r} has a constant argument {text[:80]} "
                               f"({type(a).__name__}) with no stable spelling; the graph cannot "
                               "be keyed")
        return {"$repr": f"{type(a).__module__}.{type(a).__qualname__}:{text}"}


@functools.lru_cache(maxsize=64)
def _module_fingerprint(module: str) -> str:
    """The version of the distribution that provides ``module`` (``torchao 0.18.0``), else the
    sha256 of the module's source file; "" when neither is known."""
    import importlib.metadata
    import sys

    top = module.split(".", 1)[0]
    for dist in (top, top.replace("_", "-")):  # the usual case: the distribution's own name
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    path = getattr(sys.modules.get(module), "__file__", None)
    if path:
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return ""
    return ""


def _code_text(code: types.CodeType) -> str:
    consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return repr((code.co_code.hex(), consts, code.co_names, code.co_varnames))


def _tensor_digest(t: torch.Tensor) -> str:
    if t.is_meta or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return f"{t.dtype}:{list(t.shape)}:{type(t).__name__}"
    data = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{data.dtype}:{list(data.shape)}".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def _graph_lines(gm: torch.fx.GraphModule, canon: _Canon, examples: Sequence[Any] | None,
                 depth: int = 0) -> list[Any]:
    if depth > 8:
        raise BackendError("graph nests more than 8 subgraphs deep; cannot key it")
    index: dict[torch.fx.Node, int] = {}
    lines: list[Any] = []
    placeholders = 0
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            ex = examples[placeholders] if examples is not None and placeholders < len(examples) else None
            placeholders += 1
            lines.append(["placeholder", canon.placeholder(node, ex)])
            continue
        args = torch.fx.node.map_arg((node.args, node.kwargs),
                                     lambda n: _NodeRef(index[n]))  # type: ignore[arg-type,return-value]  # a stand-in, never run
        entry: list[Any] = [node.op, canon.target(node), _refs(args, canon, node.name)]
        if node.op == "get_attr":
            entry.append(_attr(gm, str(node.target), canon, depth))
        elif node.op == "call_module":
            entry.append(_attr(gm, str(node.target), canon, depth))
        lines.append(entry)
    return lines


class _NodeRef:
    def __init__(self, i: int) -> None:
        self.i = i


def _refs(a: Any, canon: _Canon, where: str) -> Any:
    if isinstance(a, _NodeRef):
        return f"%{a.i}"
    if isinstance(a, (tuple, list)):
        return [type(a).__name__, *[_refs(x, canon, where) for x in a]]
    if isinstance(a, dict):
        return {"$dict": [[str(k), _refs(v, canon, where)] for k, v in a.items()]}
    if isinstance(a, slice):  # x[:, :n] with n a node of the graph
        return {"$slice": [_refs(a.start, canon, where), _refs(a.stop, canon, where),
                           _refs(a.step, canon, where)]}
    return canon.const(a, where)


def _attr(gm: torch.fx.GraphModule, target: str, canon: _Canon, depth: int) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, torch.fx.GraphModule):
        return {"$graph": _graph_lines(obj, canon, None, depth + 1)}
    if isinstance(obj, torch.Tensor):
        return {"$tensor": _tensor_digest(obj)}
    if isinstance(obj, torch.nn.Module):
        raise BackendError(f"graph calls module {target!r} ({type(obj).__name__}) that is not an "
                           "FX graph; cannot key it")
    return canon.const(obj, target)


def graph_signature(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The canonical form itself (placeholders, nodes, custom op schemas) — what is hashed."""
    canon = _Canon()
    lines = _graph_lines(gm, canon, list(example_inputs))
    return {"lines": lines, "custom_ops": dict(sorted(canon.custom_ops.items())),
            "ranges": canon.ranges, "functions": dict(sorted(canon.functions.items()))}


def graph_factors(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The ``graph`` group of a backend key: digests of the canonical form, with counts and the
    inputs' summary kept readable for ``aotc explain`` and ``inspect``."""
    import json

    sig = graph_signature(gm, example_inputs)
    inputs = [line[1] for line in sig["lines"] if line[0] == "placeholder"]
    body = [line for line in sig["lines"] if line[0] != "placeholder"]

    def digest(x: Any) -> str:
        return hashlib.sha256(json.dumps(x, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    kinds: dict[str, int] = {}
    for p in inputs:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    return {"nodes": digest(body), "inputs": digest(inputs), "n_nodes": len(body),
            "n_inputs": len(inputs), "input_kinds": dict(sorted(kinds.items())),
            "custom_ops": sig["custom_ops"], "symbol_ranges": sig["ranges"],
            "functions": sig["functions"], "global": global_state()}


def global_state() -> dict[str, Any]:
    """The process state a graph is compiled under that Dynamo guards on but does not put in the
    graph: autocast per device, the default dtype, deterministic algorithms, grad mode."""
    state: dict[str, Any] = {"default_dtype": str(torch.get_default_dtype()),
                             "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
                             "grad": bool(torch.is_grad_enabled())}
    for dev in ("cpu", "cuda"):
        try:
            on = bool(torch.is_autocast_enabled(dev))
            state[f"autocast_{dev}"] = str(torch.get_autocast_dtype(dev)) if on else None
        except (TypeError, RuntimeError, AttributeError):  # an older torch: one global flag
            state[f"autocast_{dev}"] = None
    return state


def static_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether no input of ``gm`` has a symbolic size or stride (a float input may be symbolic):
    Dynamo's guards then fix every input's layout."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.SymInt):
            return False
        if isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt)
                                                 for s in (*val.shape, *val.stride())):
            return False
    return True


def graph_device(example_inputs: Sequence[Any]) -> str:
    """The device the graph runs on: that of its first tensor input (``cpu`` when none)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return str(x.device) if x.device.type != "cpu" else "cpu"
    return "cpu"
