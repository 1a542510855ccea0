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

import hashlib
import math
import operator
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from aotc._torch import dynamo
from aotc._torch.ops import op_name, op_schema
from aotc.errors import BackendError

__all__ = ["global_state", "graph_device", "graph_factors", "graph_signature"]

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
            kind = type(example) if isinstance(example, torch.Tensor) else torch.Tensor
            sub = None if kind in (torch.Tensor, torch.nn.Parameter) else f"{kind.__module__}.{kind.__qualname__}"
            if sub is not None and hasattr(example, "__tensor_flatten__"):
                raise BackendError(f"graph input {node.name!r} is a tensor subclass ({sub}); its "
                                   "inner state cannot be keyed yet: not supported by the aotc backend")
            return {"kind": "tensor", "dtype": str(val.dtype).removeprefix("torch."),
                    "shape": [self.size(d) for d in val.shape],
                    "stride": [self.size(d) for d in val.stride()],
                    "device": str(val.device), "param": isinstance(example, torch.nn.Parameter),
                    "requires_grad": bool(val.requires_grad)}
        if isinstance(example, (bool, int, float)) and not isinstance(example, torch.SymInt):
            return {"kind": "scalar", "type": type(example).__name__}
        if isinstance(val, (torch.SymFloat, torch.SymBool)):
            return {"kind": "symbol", "type": type(val).__name__, "expr": str(dynamo.symbol_key(val))}
        t = type(example)
        return {"kind": "opaque", "type": f"{t.__module__}.{t.__qualname__}"}

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
        mod = getattr(t, "__module__", None) or type(t).__module__
        qual = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
        if not qual or "<" in qual:
            raise BackendError(f"graph node {node.name!r} calls {t!r}, which has no stable name; "
                               "the graph cannot be keyed (make it a torch op or a module function)")
        full = f"{mod}.{qual}"
        if isinstance(t, types.FunctionType) and not mod.startswith(("torch", "operator", "math")):
            self.functions[full] = _function_digest(t)  # traced into the artifact: its body counts
        return full

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


def _function_digest(fn: Any) -> str:
    """sha256 of a Python function's source (its bytecode and constants when there is none)."""
    import inspect

    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        code = fn.__code__
        text = repr((code.co_code, [c for c in code.co_consts if not hasattr(c, "co_code")]))
    return hashlib.sha256(text.encode()).hexdigest()


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


def graph_device(example_inputs: Sequence[Any]) -> str:
    """The device the graph runs on: that of its first tensor input (``cpu`` when none)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return str(x.device) if x.device.type != "cpu" else "cpu"
    return "cpu"
