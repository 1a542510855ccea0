"""FX graphs as plain JSON, and a tiny interpreter to run them with no Dynamo and no FX codegen.

The stitching graph (placeholders → piece calls → getitems → output) and each splitting piece
(one attention call plus the odd getitem) are stored this way in the ``Program``: the format is
ours, readable, free of pickle, and stable across torch versions as long as the ops exist.

Node targets are written as
- ``"op:ns::name.overload"`` for an ``OpOverload`` (resolved through ``torch.ops``),
- ``"fn:module.qualname"`` for a Python callable (``operator.getitem``,
  ``torch._C._nn.scaled_dot_product_attention``, …), resolved by import + getattr,
- ``"mod:submod_3"`` for a ``call_module`` of the stitching graph (a piece),
- ``"method:view"`` for a ``call_method``.
Arguments are JSON with ``{"$node": name}``, ``{"$dtype": "float32"}``, ``{"$device": "cuda:0"}``,
``{"$tuple": [...]}`` and ``{"$slice": [start, stop, step]}`` for the values JSON lacks.
"""

from __future__ import annotations

import importlib
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from aotc._torch.ops import op_name
from aotc.errors import CompileError, LoadError

Encoded = dict[str, Any]


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_module":
        return f"mod:{t}"
    if node.op == "call_method":
        return f"method:{t}"
    op = op_name(t)
    if op is not None and not op.startswith("higher_order::"):
        return f"op:{op}"
    mod, name = getattr(t, "__module__", None), getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if t is operator.getitem:
        return "fn:operator.getitem"
    if mod and name and "<" not in name:
        if mod == "torch._C._nn" or (mod == "torch.nn.functional"):
            return f"fn:{mod}.{name}"
        try:
            if _resolve_fn(f"{mod}.{name}") is t:
                return f"fn:{mod}.{name}"
        except LoadError:
            pass
    raise CompileError(f"cannot serialize graph node {node.name!r}: target {t!r} has no stable name")


def _encode_arg(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        return {"$node": a.name}
    if isinstance(a, tuple):
        return {"$tuple": [_encode_arg(x) for x in a]}
    if isinstance(a, list):
        return [_encode_arg(x) for x in a]
    if isinstance(a, dict):
        return {"$dict": {str(k): _encode_arg(v) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"$dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"$device": str(a)}
    if isinstance(a, slice):
        return {"$slice": [_encode_arg(a.start), _encode_arg(a.stop), _encode_arg(a.step)]}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, torch.memory_format):
        return {"$memory_format": str(a).removeprefix("torch.")}
    raise CompileError(f"cannot serialize graph argument {a!r} ({type(a).__name__})")


def encode_graph(gm: torch.fx.GraphModule) -> Encoded:
    """The graph of ``gm`` as JSON-able nodes. ``get_attr`` is refused (pieces take no constants
    from the stitching graph: parameters are graph inputs)."""
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            nodes.append({"op": "placeholder", "name": n.name})
        elif n.op == "output":
            nodes.append({"op": "output", "name": n.name, "args": _encode_arg(n.args[0])})
        elif n.op in ("call_function", "call_module", "call_method"):
            nodes.append({"op": "call", "name": n.name, "target": _target_name(n),
                          "args": _encode_arg(tuple(n.args)), "kwargs": _encode_arg(dict(n.kwargs))})
        else:
            raise CompileError(f"cannot serialize graph node {n.name!r} of kind {n.op!r}")
    return {"nodes": nodes}


def _resolve_fn(qualname: str) -> Callable[..., Any]:
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            break
        return obj
    raise LoadError(f"graph refers to {qualname!r}, which this torch does not have")


def _resolve_op(name: str) -> Callable[..., Any]:
    ns, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), opname)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as e:
        raise LoadError(
            f"graph calls op {name!r}, which is not registered in this process; import the module "
            "that defines it (building the model from its manifest does)"
        ) from e


_Getter = Callable[[Mapping[str, Any]], Any]


def _compile_arg(a: Any) -> tuple[bool, _Getter]:
    """``(constant, getter)``: a function of the environment that rebuilds the encoded argument
    ``a`` (decoded once, here: the interpreter's per-call cost is then one call per node)."""
    if isinstance(a, dict):
        if "$node" in a:
            key = a["$node"]
            return False, lambda env: env[key]
        for tag, build in (("$tuple", tuple), ("$slice", lambda xs: slice(*xs))):
            if tag in a:
                parts = [_compile_arg(x) for x in a[tag]]
                if all(c for c, _ in parts):
                    value = build([g({}) for _, g in parts])
                    return True, lambda env: value  # noqa: B023 - returned at once: no later binding
                getters = [g for _, g in parts]
                return False, lambda env: build([g(env) for g in getters])  # noqa: B023 - as above
        if "$dict" in a:
            items = [(k, _compile_arg(v)[1]) for k, v in a["$dict"].items()]
            return False, lambda env: {k: g(env) for k, g in items}
        for tag, make in (("$dtype", lambda v: getattr(torch, v)), ("$device", torch.device),
                          ("$memory_format", lambda v: getattr(torch, v))):
            if tag in a:
                made: Any = make(a[tag])
                return True, lambda env: made  # noqa: B023 - returned at once: no later binding
    if isinstance(a, list):
        parts = [_compile_arg(x) for x in a]
        getters = [g for _, g in parts]
        return all(c for c, _ in parts), lambda env: [g(env) for g in getters]
    return True, lambda env: a


class GraphProgram:
    """A decoded graph, ready to run: ``program(modules, *args)``. Targets are resolved once."""

    def __init__(self, encoded: Encoded) -> None:
        self.placeholders: list[str] = []
        self.steps: list[tuple[str, str, Any, _Getter, _Getter]] = []  # name, kind, fn, args, kwargs
        self.output: _Getter = lambda env: None
        for n in encoded["nodes"]:
            if n["op"] == "placeholder":
                self.placeholders.append(n["name"])
            elif n["op"] == "output":
                self.output = _compile_arg(n["args"])[1]
            else:
                kind, _, what = n["target"].partition(":")
                fn: Any = what
                if kind == "op":
                    fn = _resolve_op(what)
                elif kind == "fn":
                    fn = operator.getitem if what == "operator.getitem" else _resolve_fn(what)
                self.steps.append((n["name"], kind, fn, _compile_arg(n["args"])[1],
                                   _compile_arg(n["kwargs"])[1]))

        self._compiled = _as_python(encoded)  # None: the interpreter below runs it

    def __call__(self, modules: Mapping[str, Callable[..., Any]], *args: Any) -> Any:
        if len(args) != len(self.placeholders):
            raise LoadError(f"graph takes {len(self.placeholders)} inputs, got {len(args)}")
        if self._compiled is not None:
            fn, fns, consts = self._compiled
            return fn(modules, fns, consts, args)
        env: dict[str, Any] = dict(zip(self.placeholders, args))
        for name, kind, fn, a, k in self.steps:
            args_ = a(env)
            kwargs = k(env)
            if kind == "mod":
                env[name] = modules[fn](*args_, **kwargs)
            elif kind == "method":
                env[name] = getattr(args_[0], fn)(*args_[1:], **kwargs)
            else:
                env[name] = fn(*args_, **kwargs)
        return self.output(env)



_LITERALS = (bool, int, str, type(None))


@dataclass(frozen=True)
class Bound:
    """A ``call_module`` target bound into a straight-line function (:func:`straight_line`):
    ``fn`` is called with the node's arguments (through ``prepare(args, *prepare_args)`` first
    when ``prepare`` is set) and, when ``first``, its result's item 0 is the node's value."""

    fn: Callable[..., Any]
    first: bool = False
    prepare: Callable[..., Any] | None = None
    prepare_args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class StraightLine:
    """A graph as one Python function of its placeholders (:func:`straight_line`); ``lines``:
    the line of ``fn``'s code that calls each bound module, by module name."""

    fn: Callable[..., Any]
    lines: dict[int, str]


def straight_line(encoded: Encoded, bound: Mapping[str, Bound]) -> StraightLine | None:
    """``encoded`` as one function ``fn(*placeholders)`` whose ``call_module`` nodes call
    ``bound[name]`` directly — no table lookup, no wrapper object, no per-call dispatch — or None
    when the graph has anything the writer does not know or a module that is not bound."""
    got = _as_python(encoded, bound)
    if got is None:
        return None
    fn, lines = got
    return StraightLine(fn, lines)


def _as_python(encoded: Encoded, bound: Mapping[str, Bound] | None = None) -> Any:
    """The graph as one Python function — a straight line of calls, each value deleted after
    its last use, as FX's own codegen writes it — or None when the graph has anything this
    writer does not know (the interpreter runs it then). Decoded once: a call runs no per-node
    Python of ours. Without ``bound``: ``(fn(modules, fns, consts, args), fns, consts)``; with
    it (:func:`straight_line`): ``(fn(*args), {line: module name})``."""
    fns: list[Any] = []
    consts: list[Any] = []
    var: dict[str, str] = {}
    lines_of: dict[int, str] = {}

    def const(value: Any) -> str:
        consts.append(value)
        return f"_c[{len(consts) - 1}]"

    def fn_ref(value: Any) -> str:
        fns.append(value)
        return f"_f[{len(fns) - 1}]"

    def expr(a: Any) -> str:
        if isinstance(a, dict):
            if "$node" in a:
                return var[a["$node"]]
            if "$tuple" in a:
                items = [expr(x) for x in a["$tuple"]]
                return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
            if "$slice" in a:
                return "slice(" + ", ".join(expr(x) for x in a["$slice"]) + ")"
            if "$dict" in a:
                return "{" + ", ".join(f"{k!r}: {expr(v)}" for k, v in a["$dict"].items()) + "}"
            for tag, make in (("$dtype", lambda v: getattr(torch, v)), ("$device", torch.device),
                              ("$memory_format", lambda v: getattr(torch, v))):
                if tag in a:
                    return const(make(a[tag]))
            raise ValueError(f"unknown encoded argument {a!r}")
        if isinstance(a, list):
            return "[" + ", ".join(expr(x) for x in a) + "]"
        if isinstance(a, _LITERALS):
            return repr(a)
        return const(a)  # floats (nan, inf) and anything else: by reference

    try:
        nodes = encoded["nodes"]
        params = [n["name"] for n in nodes if n["op"] == "placeholder"]
        for i, name in enumerate(params):
            var[name] = f"p{i}"
        if bound is None:
            lines = ["def _stitched(_m, _f, _c, _a):"]
            if params:
                lines.append("    " + ", ".join(var[n] for n in params) + ", = _a")
        else:
            lines = [f"def _stitched({', '.join(var[n] for n in params)}):"]
        body = [n for n in nodes if n["op"] == "call"]
        last_use: dict[str, int] = {}
        for i, n in enumerate(body):
            for ref in _node_refs(n["args"]) + _node_refs(n["kwargs"]):
                last_use[ref] = i
        output = next(n for n in nodes if n["op"] == "output")
        kept = set(_node_refs(output["args"]))
        dies_at: dict[int, list[str]] = {}  # (one pass: a scan of every value per line grew as n²)
        for ref, at in last_use.items():
            if ref not in kept:
                dies_at.setdefault(at, []).append(ref)
        for i, n in enumerate(body):
            kind, _, what = n["target"].partition(":")
            var[n["name"]] = f"v{i}"
            args = [expr(x) for x in n["args"]["$tuple"]]
            kwargs = [f"{k}={expr(v)}" for k, v in n["kwargs"]["$dict"].items()]
            if any(not k.isidentifier() for k in n["kwargs"]["$dict"]):
                return None
            tail = ""
            if kind == "mod" and bound is not None:
                b = bound.get(what)
                if b is None or kwargs:
                    return None
                call = fn_ref(b.fn)
                if b.prepare is not None:
                    extra = ", ".join(const(x) for x in b.prepare_args)
                    args = [f"*{fn_ref(b.prepare)}(({', '.join(args)}{',' if len(args) == 1 else ''}), {extra})"]
                tail = "[0]" if b.first else ""
                lines_of[len(lines) + 1] = what
            elif kind == "mod":
                call = f"_m[{what!r}]"
            elif kind == "method":
                if not what.isidentifier() or not args:
                    return None
                call, args = f"{args[0]}.{what}", args[1:]
            elif kind == "op":
                call = fn_ref(_resolve_op(what))
            elif kind == "fn":
                call = fn_ref(operator.getitem if what == "operator.getitem" else _resolve_fn(what))
            else:
                return None
            lines.append(f"    v{i} = {call}({', '.join(args + kwargs)}){tail}")
            dead = sorted({var[r] for r in dies_at.get(i, ()) if r in var})
            if dead:
                lines.append(f"    del {', '.join(dead)}")
        lines.append(f"    return {expr(output['args'])}")
        scope: dict[str, Any] = {"_f": fns, "_c": consts}
        exec(compile("\n".join(lines) + "\n", "<aotc stitch>", "exec"), scope)  # noqa: S102 - our own writer's text
        if bound is not None:
            return scope["_stitched"], lines_of
        return scope["_stitched"], fns, consts
    except (KeyError, TypeError, ValueError, SyntaxError, StopIteration):
        return None


def _node_refs(a: Any) -> list[str]:
    """The node names an encoded argument refers to."""
    if isinstance(a, dict):
        if "$node" in a:
            return [a["$node"]]
        return [r for v in a.values() for r in _node_refs(v)]
    if isinstance(a, list):
        return [r for x in a for r in _node_refs(x)]
    return []


def _shape_text(encoded: Encoded) -> str:
    """``encoded`` as text with its node names left out (a reference names the node's position):
    two graphs that differ only in names — one attention piece per layer — read the same."""
    at = {n["name"]: i for i, n in enumerate(encoded["nodes"])}

    def plain(a: Any) -> Any:
        if isinstance(a, dict):
            if "$node" in a:
                return {"$node": at[a["$node"]]}
            return {k: plain(v) for k, v in a.items()}
        if isinstance(a, list):
            return [plain(x) for x in a]
        return a

    return json.dumps([{k: plain(v) for k, v in n.items() if k != "name"} for n in encoded["nodes"]],
                      sort_keys=True)


_DECODED: dict[str, tuple[GraphProgram, StraightLine | None]] = {}
_DECODED_MAX = 1024


def decoded(encoded: Encoded) -> tuple[GraphProgram, StraightLine | None]:
    """``(GraphProgram(encoded), straight_line(encoded, {}))``, decoded once per graph shape in
    this process: a program's attention pieces (one per layer, alike but for names), and the
    same program rebuilt (the compile's check builds two runners, the load a third), share
    them. Both are stateless: the modules and arguments come with each call."""
    try:
        text = _shape_text(encoded)
    except (KeyError, TypeError, ValueError):  # a graph the writer cannot read: decoded as it is
        return GraphProgram(encoded), straight_line(encoded, {})
    got = _DECODED.get(text)
    if got is None:
        got = (GraphProgram(encoded), straight_line(encoded, {}))
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        _DECODED[text] = got
    return got
