"""Piecewise split of a captured graph at its splitting ops (attention).

``split_module(..., keep_original_order=True)`` with a partition callback that gives every
splitting-op call a partition of its own, so N attention calls give ``graph, attn, graph, …,
graph`` = 2N+1 pieces, in execution order. Each piece keeps the fake example values (with the
symbolic token size) that flowed into it, so it can be compiled standalone with Inductor.

Op names: ``"ns::op"`` (``"aotc::attention"``, ``"aten::scaled_dot_product_attention"``), with or
without an overload (``.default``), or a Python qualname (``"torch.nn.functional.
scaled_dot_product_attention"``). After Dynamo, a Hugging Face model's
``F.scaled_dot_product_attention`` call is a ``call_function`` whose target is the builtin
``torch._C._nn.scaled_dot_product_attention``; it is matched by
``aten::scaled_dot_product_attention`` because the aten op of the same name exists.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from aotc._torch.ops import graph_module, lazy_graph_modules, op_name
from aotc.compile.masks import hoist_boolean_masks
from aotc.errors import SplitError

__all__ = ["Piece", "SplitResult", "node_op_names", "split", "splitting_op_of"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One submodule of the split graph.

    ``name``: the attribute name in ``stitch`` (``submod_0``…); ``gm``: the piece's graph;
    ``is_splitting``: it holds exactly one splitting-op call; ``example_inputs``: the fake (or
    real) values flowing into its placeholders, in order (symbolic sizes kept).
    """

    name: str
    gm: torch.fx.GraphModule
    is_splitting: bool
    example_inputs: tuple[Any, ...]
    real_inputs: dict[int, Any] = dataclasses.field(default_factory=dict)  # position -> real value


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """``stitch`` calls ``pieces`` in order; ``warnings`` are human-readable notes."""

    stitch: torch.fx.GraphModule
    pieces: list[Piece]
    warnings: list[str]


_TORCH_FUNCTION_MODULES = (
    None, "torch", "torch._C._nn", "torch.nn.functional", "torch._C._VariableFunctions",
)


def _strip_overload(name: str) -> str:
    ns, _, rest = name.partition("::")
    return f"{ns}::{rest.split('.')[0]}" if rest else name


def node_op_names(node: torch.fx.Node) -> set[str]:
    """All the names a ``call_function`` node answers to (see module docstring)."""
    if node.op != "call_function":
        return set()
    t = node.target
    names: set[str] = set()
    op = op_name(t)
    if op is not None:
        names |= {op, _strip_overload(op)}
    elif callable(t):
        fn = getattr(t, "__name__", None)
        mod = getattr(t, "__module__", None)
        if fn:
            if mod:
                names.add(f"{mod}.{fn}")
            if mod in _TORCH_FUNCTION_MODULES:
                names.add(f"torch.nn.functional.{fn}" if mod == "torch._C._nn" else f"torch.{fn}")
                if hasattr(torch.ops.aten, fn):
                    names.add(f"aten::{fn}")
    return names


def splitting_op_of(gm: torch.fx.GraphModule) -> str:
    """The operator name (``ns::op…``) of a splitting piece's op, for its record ("?": none)."""
    for node in gm.graph.nodes:
        for n in sorted(node_op_names(node)):
            if "::" in n:
                return n
    return "?"


def _example(node: Any) -> Any:
    if not isinstance(node, torch.fx.Node):
        return node
    for k in ("example_value", "val"):
        if k in node.meta:
            return node.meta[k]
    raise SplitError(
        f"node {node.name!r} carries no example value (meta['example_value'] / meta['val']); "
        "split needs a graph captured by aotc.compile.capture (Dynamo)"
    )


def _canonical(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its nodes named after their order alone (inputs ``in_0``, ``in_1``, …; the
    others ``add``, ``add_1``, … per base name): two pieces that compute the same thing then carry the same names, and
    Inductor's cache key reads them (a layer inlined from a region at depth k names its nodes
    ``add_6``, the same layer traced plainly ``add``)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    seen: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":  # (called by position: a name of its own order alone)
            env[n] = graph.placeholder(f"in_{len(env)}", type_expr=n.type)
            env[n].meta = n.meta
            continue
        if n.op == "output":
            env[n] = graph.node_copy(n, lambda a: env[a])
            continue
        base = re.sub(r"_\d+$", "", n.name) or "v"
        k = seen.get(base, 0)
        seen[base] = k + 1
        env[n] = graph.create_node(n.op, n.target, torch.fx.node.map_arg(n.args, lambda a: env[a]),
                                   torch.fx.node.map_arg(n.kwargs, lambda a: env[a]),
                                   name=base if k == 0 else f"{base}_{k}", type_expr=n.type)
        env[n].meta = n.meta
    return graph_module(gm, graph, gm.__class__.__name__)


def split(gm: torch.fx.GraphModule, splitting_ops: list[str]) -> SplitResult:
    """Split ``gm`` so each call of an op in ``splitting_ops`` is alone in its own piece.

    Returns the stitching graph and the pieces in execution order (2N+1 for N calls when no two
    splitting calls are adjacent). A graph with no splitting-op call gives one piece and a
    warning. Raises :class:`SplitError` if the split does not reproduce the expected layout.
    """
    wanted = {_strip_overload(s.strip()) for s in splitting_ops if s.strip()}
    hoist_boolean_masks(gm, node_op_names, wanted)  # converted once, not per layer
    warnings: list[str] = []
    part_of: dict[torch.fx.Node, int] = {}
    pid, n_split, seen_names = 0, 0, set()
    split_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        names = node_op_names(node)
        seen_names |= {n for n in names if "::" in n}
        if names & wanted:
            pid += 1
            part_of[node] = pid
            split_parts.add(pid)
            n_split += 1
            pid += 1
        else:
            part_of[node] = pid
    if n_split == 0 and wanted:  # (no splitting ops asked for: one piece is what was asked)
        warnings.append(
            f"no call of the splitting ops {sorted(wanted)} found in the graph; it stays one piece "
            f"(ops seen: {', '.join(sorted(seen_names)[:12]) or 'none'})"
        )

    kwargs: dict[str, Any] = {"keep_original_order": True}
    if "tuple_return" in inspect.signature(split_module).parameters:
        kwargs["tuple_return"] = True  # every piece returns a tuple, as compile_fx expects
    with lazy_graph_modules():  # (65 pieces at 32 layers: their code written when used)
        try:
            stitch = split_module(gm, None, lambda n: part_of[n], **kwargs)  # type: ignore[arg-type]  # torch accepts None: no root module to copy attributes from
        except Exception as e:  # noqa: BLE001 - split_module raises assorted errors
            raise SplitError(f"torch.fx split_module failed on the captured graph: {e}") from e
        for name, sub in list(stitch.named_children()):  # the same piece at any depth: one key
            if isinstance(sub, torch.fx.GraphModule) and int(name.rsplit("_", 1)[1]) not in split_parts:
                setattr(stitch, name, _canonical(sub))  # (attention runs eagerly: no key to match)

    # Values flowing into each piece: the stitch graph's placeholders carry the original
    # metas; piece outputs are getitem nodes whose values we read from the piece's output node.
    value: dict[torch.fx.Node, Any] = {}
    pieces: list[Piece] = []
    orig = {n.name: n for n in gm.graph.nodes}
    for node in stitch.graph.nodes:
        if node.op == "placeholder":
            src = orig.get(node.name)
            value[node] = _example(src if src is not None and not node.meta else node)
        elif node.op == "call_module":
            sub = getattr(stitch, node.target)
            ex = tuple(value[a] if isinstance(a, torch.fx.Node) else a for a in node.args)
            pid_ = int(str(node.target).rsplit("_", 1)[1])
            pieces.append(Piece(str(node.target), sub, pid_ in split_parts, ex))
            out = next(n for n in reversed(sub.graph.nodes) if n.op == "output").args[0]
            value[node] = (
                tuple(_example(o) for o in out) if isinstance(out, (tuple, list)) else _example(out)
            )
        elif node.op == "call_function":
            base, idx = node.args[0], node.args[1]
            value[node] = value[base][idx] if node.target.__name__ == "getitem" else None
    if n_split and len(pieces) != 2 * n_split + 1:
        warnings.append(
            f"{n_split} splitting-op calls gave {len(pieces)} pieces, not {2 * n_split + 1} "
            "(a splitting op at the graph's start/end, or two in a row, leaves no piece between)"
        )
    for p in pieces:
        if p.is_splitting:
            calls = [n for n in p.gm.graph.nodes if node_op_names(n) & wanted]
            if len(calls) != 1:
                raise SplitError(
                    f"piece {p.name} should hold one splitting-op call, has {len(calls)}"
                )
    return SplitResult(stitch=stitch, pieces=pieces, warnings=warnings)
