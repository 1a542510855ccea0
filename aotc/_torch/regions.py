"""Dynamo's nested compile regions (``torch.compiler.nested_compile_region`` and the
``invoke_subgraph`` higher-order op it traces to): marking a module instance's ``forward`` as a
region for one trace, the region calls a graph holds, and inlining them back into a flat graph.

Dynamo traces a marked region once and, where its guards hold for a later call (another layer:
other weights, same code and attributes), stamps out the same subgraph without tracing it again;
the graph it hands the backend then calls ``invoke_subgraph(body, identifier, *operands)`` per
instance (a region called once is inlined by Dynamo itself). aotc inlines every call before its
split (attention sits inside the body), so what follows the trace sees a flat graph.

Marking is per class and undone after the trace (the class's ``forward`` is wrapped, then put
back). Not per instance: a region bound to one instance (``layer.forward = region(...)``) is
stamped out by torch 2.13 with the FIRST instance's weights at every later call — Dynamo does
not rewrite a bound ``self`` it captured (aotc's own check of each call's weights,
:mod:`aotc.compile.repeated`, refuses such a graph; a test keeps the hazard in view).
Tested on torch 2.13 (and 2.11 through ``make test-torch-compat``).
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["RegionCall", "inline_regions", "invoke_subgraph", "is_region_call", "marked", "region_calls", "supported"]


def supported() -> bool:
    """Whether this torch traces a region once and reuses it: ``nested_compile_region`` with
    ``max_reuse_entries`` (torch 2.12+, whose Dynamo stamps out a traced body). torch 2.11 has
    the region but traces it at every call — slower than no region at all — so aotc does not
    mark there."""
    import inspect

    mark = getattr(torch.compiler, "nested_compile_region", None)
    return mark is not None and _hop() is not None \
        and "max_reuse_entries" in inspect.signature(mark).parameters


def _hop() -> Any:
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


@contextlib.contextmanager
def marked(kinds: Sequence[Sequence[torch.nn.Module]], max_reuse: int = 8,
           wrap: Callable[[Any, Any], Any] | None = None) -> Iterator[list[Any]]:
    """Each group of ``kinds`` (instances of one class that aotc holds to be alike) has its
    ``forward`` traced as a nested compile region of its own for the block, then everything is
    restored (module doc). The first group of a class marks the class itself; a later group of
    the same class gets a subclass of its own for the block (``instance.__class__``), so Dynamo
    keeps one body per group and never stamps one group's body out for another. ``max_reuse``:
    the distinct bodies Dynamo may keep per region before it refuses. ``wrap(region, fn)``:
    what becomes the class's ``forward`` instead of the region itself (``fn``: the forward the
    region marks). Yields each instance's own forward (before marking), in the order of
    ``kinds``. Only where :func:`supported` holds."""
    patched: list[tuple[type, Any]] = []
    moved: list[tuple[torch.nn.Module, type]] = []
    # each class's forward before any is marked (a subclass inheriting a marked class's forward
    # must not take the marked one for its own: it would call itself)
    original: dict[type, Any] = {type(g[0]): type(g[0]).forward for g in kinds if g}
    seen: set[type] = set()
    originals: list[Any] = []
    try:
        for group in kinds:
            if not group:
                continue
            cls = type(group[0])
            if cls in seen:  # another kind of the same class: a subclass of its own
                fn = _renamed(original[cls], len(patched))
                cls = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                                  "__qualname__": cls.__qualname__})
                for m in group:
                    moved.append((m, type(m)))
                    m.__class__ = cls
            else:
                seen.add(cls)
                fn = original[cls]
            patched.append((cls, cls.__dict__.get("forward")))
            # (torch marks the function it is given with attributes: a copy of the caller's)
            region = torch.compiler.nested_compile_region(_copied(fn), max_reuse_entries=max(8, max_reuse))
            cls.forward = region if wrap is None else wrap(region, fn)
            originals += [fn] * len(group)
        yield originals
    finally:
        for cls, own in reversed(patched):
            if own is None:
                delattr(cls, "forward")  # it was inherited
            else:
                cls.forward = own
        for m, cls in moved:
            m.__class__ = cls


def _copied(fn: Any, code: types.CodeType | None = None) -> Any:
    """A function of ``fn``'s code (or ``code``) of its own: attributes set on it stay off ``fn``."""
    if not isinstance(fn, types.FunctionType):
        return fn
    out = types.FunctionType(code or fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__, out.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    out.__qualname__, out.__module__ = fn.__qualname__, fn.__module__
    return out


def _renamed(fn: Any, n: int) -> Any:
    """``fn`` with a code object of its own (Dynamo keeps the bodies it may reuse per code
    object): another kind of layer of the same class never meets the first kind's bodies."""
    return _copied(fn, fn.__code__.replace(co_name=f"{fn.__code__.co_name}_aotc_kind{n}"))


@dataclass(frozen=True)
class RegionCall:
    """One ``invoke_subgraph`` call: ``body`` (the attribute holding the traced subgraph),
    ``identifier`` (Dynamo's name of the body) and the graph nodes passed to it."""

    node: torch.fx.Node
    body: str
    identifier: str
    operands: tuple[Any, ...]


def invoke_subgraph() -> Any:
    """The higher-order op a region call calls (where :func:`supported` holds)."""
    return _hop()


def is_region_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a region's body (``invoke_subgraph``)."""
    hop = _hop()
    return hop is not None and node.op == "call_function" and node.target is hop


def region_calls(gm: torch.fx.GraphModule) -> list[RegionCall]:
    """The region calls of ``gm``'s own graph, in order."""
    hop = _hop()
    if hop is None:
        return []
    return [RegionCall(n, str(n.args[0].target), str(n.args[1]), tuple(n.args[2:]))
            for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]


def inline_regions(gm: torch.fx.GraphModule) -> int:
    """Replace every region call of ``gm`` (bodies first, recursively) by a copy of its body's
    nodes; returns how many calls were inlined. The graph is changed in place and recompiled."""
    count = 0
    for sub in list(gm.children()):
        if isinstance(sub, torch.fx.GraphModule):
            count += inline_regions(sub)
    calls = region_calls(gm)
    for call in calls:  # checked before anything changes: a graph is inlined whole or not at all
        if any(u.op != "call_function" or u.target is not operator.getitem
               or not isinstance(u.args[1], int) for u in call.node.users):
            raise RuntimeError(f"region call {call.node.name} is used other than by indexing")
    for call in calls:
        body = operator.attrgetter(call.body)(gm)
        operands = call.node.args[2:]  # read now: an earlier call's outputs were just replaced
        env: dict[torch.fx.Node, Any] = dict(zip(
            [n for n in body.graph.nodes if n.op == "placeholder"], operands))
        with gm.graph.inserting_before(call.node):
            for sub_node in body.graph.nodes:
                if sub_node.op in ("placeholder", "output"):
                    continue
                if sub_node.op == "get_attr":  # a nested body's own attribute: hoisted here
                    target = _hoist(gm, body, str(sub_node.target))
                    env[sub_node] = gm.graph.get_attr(target)
                    env[sub_node].meta = dict(sub_node.meta)
                    continue
                env[sub_node] = gm.graph.node_copy(sub_node, env.__getitem__)
        out = next(n for n in body.graph.nodes if n.op == "output").args[0]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for user in list(call.node.users):
            got = outs[int(user.args[1])]  # type: ignore[arg-type]  # an int: checked above
            user.replace_all_uses_with(env[got] if isinstance(got, torch.fx.Node) else got)
            gm.graph.erase_node(user)
        get_body = call.node.args[0]
        gm.graph.erase_node(call.node)
        if isinstance(get_body, torch.fx.Node) and not get_body.users:
            gm.graph.erase_node(get_body)
        count += 1
    if calls:
        for name in {c.body for c in calls}:
            if not any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                with contextlib.suppress(AttributeError):
                    delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
    return count


def _hoist(gm: torch.fx.GraphModule, body: torch.fx.GraphModule, target: str) -> str:
    """``body``'s attribute ``target`` registered on ``gm`` (under a free name); its name there."""
    value = operator.attrgetter(target)(body)
    name, i = target.replace(".", "_"), 0
    while hasattr(gm, name) and getattr(gm, name) is not value:
        i += 1
        name = f"{target.replace('.', '_')}_{i}"
    if not hasattr(gm, name):
        if isinstance(value, torch.nn.Module):
            gm.add_module(name, value)
        else:
            setattr(gm, name, value)
    return name
