"""Names of torch's operator objects (``torch._ops``: ``OpOverload``, ``OpOverloadPacket``,
``HigherOrderOperator``), small facts about FX graphs that need them, and FX's lazily compiled
graph modules (``torch.fx._lazy_graph_module``). Tested on torch 2.11–2.13."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

__all__ = ["graph_module", "graph_returns_tuple", "lazy_graph_modules", "mutated_args", "op_name",
           "op_schema", "stable_name", "undefined_outputs", "written_inputs", "written_values"]


def op_name(target: Any) -> str | None:
    """``"ns::op.overload"`` for an ``OpOverload``, ``"ns::op"`` for a packet,
    ``"higher_order::name"`` for a higher-order operator; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target.name())
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target._qualified_op_name)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order::{target.name()}"
    return None


def stable_name(target: Any) -> str | None:
    """The name a callable in a graph is spelled by in every process: ``module.name`` when the
    module holds it under that name (``torch.nn.functional.max_pool2d``, a ``boolean_dispatch``
    function whose qualname is ``boolean_dispatch.<locals>.fn``), else ``module.qualname``
    (``<locals>``, ``<lambda>`` included), the inner
    function of a ``functools.partial`` with ``partial(…)`` around it; None when the callable
    has no name (a callable object). A name with ``<locals>`` or ``<lambda>`` in it cannot be
    imported: a saved artifact cannot name such a function."""
    import functools
    import sys

    if isinstance(target, functools.partial):
        inner = stable_name(target.func)
        return None if inner is None else f"functools.partial({inner})"
    mod = getattr(target, "__module__", None) or type(target).__module__
    name = getattr(target, "__name__", None)
    qual = getattr(target, "__qualname__", None) or name
    if not qual or not mod:
        return None
    if isinstance(name, str) and "<" not in name:
        module = sys.modules.get(mod)  # (never imported here: a key has no side effects)
        if module is not None and getattr(module, name, None) is target:
            return f"{mod}.{name}"
    return f"{mod}.{qual}"


def written_values(n: torch.fx.Node) -> list[Any]:
    """What ``n`` writes in place: its op's ``Tensor(a!)`` arguments, the object of an item
    assignment, the tensor of an in-place function or method (``torch.relu_(x)``, ``x.mul_(2)``;
    a function by its name's trailing ``_``, a method's not a private one): its first argument,
    else (passed by keyword) every node it reads, else the node itself — never nothing. Lists
    are opened: a ``_foreach_*_`` op writes every tensor of its first list."""
    import operator

    in_place = (n.op == "call_function" and (n.target is operator.setitem
                                             or str(getattr(n.target, "__name__", "")).endswith("_"))
                or n.op == "call_method" and str(n.target).endswith("_") and not str(n.target).startswith("_"))
    if in_place:
        return _flat(n.args[:1]) or list(n.all_input_nodes) or [n]
    return _flat(mutated_args(n)) if n.op == "call_function" else []


def _flat(values: Any) -> list[Any]:
    """``values`` with every list or tuple in it opened (``_foreach_add_``'s first argument is
    a list of the tensors it writes)."""
    out: list[Any] = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, (list, tuple)) else [v])
    return out


def written_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """The positions of ``gm``'s placeholders that it may write in place: every placeholder
    among the ancestors of a value written in place (:func:`written_values`; an ancestor, not
    only the value itself, because the value may be a view of it). Conservative: a placeholder
    outside the set is only read."""
    nodes = list(gm.graph.nodes)
    seen: set[torch.fx.Node] = set()
    todo = [a for n in nodes for a in written_values(n) if isinstance(a, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    return frozenset(i for i, p in enumerate(placeholders) if p in seen)


def op_schema(target: Any) -> str:
    """The schema of an op (every overload's, sorted, for a packet); "" for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return " | ".join(sorted(str(getattr(target, o)._schema) for o in target.overloads()))
    return ""


def mutated_args(node: torch.fx.Node) -> list[Any]:
    """The argument values (nodes or constants) a ``call_function`` of an op writes in place,
    from its schema's alias annotations (``Tensor(a!)``); [] for anything else."""
    t: Any = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        t = getattr(t, "default", None)
    if not isinstance(t, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(t._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.kwarg_only or i >= len(node.args):
            if arg.name in node.kwargs:
                out.append(node.kwargs[arg.name])
        else:
            out.append(node.args[i])
    return out


def graph_returns_tuple(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph's output node returns a tuple/list (Inductor's requirement)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


_EMPTY_FUNCTIONS = {"empty", "empty_like", "empty_strided"}
_EMPTY_METHODS = {"new_empty", "new_empty_strided"}


def undefined_outputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the piece's outputs that the piece allocates (``torch.empty_like`` …) and
    never writes: a later piece fills them (vLLM's out-variant attention takes its ``output``
    this way), so their contents are undefined when the piece returns."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    found = set()
    for i, v in enumerate(values):
        if not isinstance(v, torch.fx.Node) or set(v.users) != {out}:
            continue
        target = v.target
        if v.op == "call_method" and target in _EMPTY_METHODS:
            found.add(i)
        elif v.op == "call_function":
            name = op_name(target) or str(getattr(target, "__name__", ""))
            if name.split("::")[-1].split(".")[0] in _EMPTY_FUNCTIONS:
                found.add(i)
    return frozenset(found)


@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """Graph modules made in the block (by FX's ``split_module``, by :func:`graph_module`) write
    and compile their Python code when first called or read, not when made: a split makes one per
    piece, most of which only a structural key ever reads. A no-op where torch lacks it."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        yield
        return
    with _use_lazy_graph_module(True):
        yield


def graph_module(root: Any, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph, class_name)``, lazily compiled inside
    :func:`lazy_graph_modules`."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module
    except ImportError:
        return torch.fx.GraphModule(root, graph, class_name)
    return _make_graph_module(root, graph, class_name)
