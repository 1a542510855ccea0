"""The stamp-out: each ``layer_call`` node of a trace made under
:func:`aotc._torch.layer_calls.stamping` replaced by a region call of its kind's traced body, given
its own layer's weights and its own inputs — what Dynamo's reuse would have made of it, without
Dynamo tracing the layer (it costs a fraction of a millisecond a layer instead of ~15 ms).

How each operand of the new call is found: the kind's two traced calls (the body and Dynamo's
reuse of it for the second layer) are read operand by operand against the arguments each layer
was called with (their ``layer_exit`` nodes): an operand is a weight of the call's own layer
(then the called layer's weight of the same name), one of the layer's arguments (the called
layer's argument in the same place), or a size symbol (shared). Anything else — a tensor the
body reads from outside its arguments and its own weights — refuses the stamp-out. Before
anything changes, every called layer is checked: its arguments have the traced layers' structure
(same containers, same constants) and each tensor argument the same meta (shape, strides, dtype,
device); Dynamo must have reused the body for the second layer (no side effects, guards held);
the layers themselves share a structure key (:func:`aotc.compile.repeated.structure_key`, the
caller's grouping). What the stamp-out makes is then proven as Dynamo's own region calls are
(:func:`aotc.compile.repeated._prove`) and inlined (:func:`aotc._torch.regions.inline_regions`).

Weights a traced graph did not lift (the called layers') become new placeholders after the
others, fed by name as every other weight (``ArgSlot``), their fake values made by the graph's
own fake mode.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from aotc._torch import layer_calls, regions
from aotc.compile.capture import ArgSlot, Captured
from aotc.errors import CaptureError

__all__ = ["stamp_out"]


def _meta(node: Any) -> Any:
    """What must agree between two arguments in the same place: a tensor's shape, strides,
    dtype and device (symbolic sizes by their expression: comparing them adds no guard)."""
    if not isinstance(node, torch.fx.Node):
        return ("const", type(node).__name__, node)
    val = node.meta.get("example_value")
    if isinstance(val, torch.Tensor):
        return ("tensor", tuple(map(str, val.shape)), tuple(map(str, val.stride())), val.dtype, val.device)
    if isinstance(val, torch.SymInt):
        return ("symint", str(val))
    return ("node", type(val).__name__)


def _layer_args(node: torch.fx.Node, skip: int) -> tuple[list[Any], Any]:
    return pytree.tree_flatten((tuple(node.args[skip:]), dict(node.kwargs)))


def _out_map(node: torch.fx.Node, value: Any) -> None:
    """Every use of ``node`` (a call returning ``value``: a node or a tuple of them; used by
    indexing only, checked before) made a use of ``value`` itself; ``node`` erased."""
    if isinstance(value, (tuple, list)):
        for user in list(node.users):
            user.replace_all_uses_with(value[user.args[1]])  # type: ignore[index]  # an int index
            user.graph.erase_node(user)
    else:
        node.replace_all_uses_with(value)
    node.graph.erase_node(node)


@dataclasses.dataclass
class _Kind:
    hop: torch.fx.Node            # the second traced call (Dynamo's reuse of the body)
    exit: torch.fx.Node           # its layer_exit
    roles: list[tuple[str, Any]]  # per operand: ("weight", rel) / ("arg", i) / ("shared", node)
    spec: Any
    metas: list[Any]


def _hop_of(exit_node: torch.fx.Node, layer: str) -> torch.fx.Node:
    """The region call whose outputs a ``layer_exit`` hands on (each output one of its items)."""
    leaves = pytree.tree_leaves(exit_node.args[1])
    hops = {v.args[0] for v in leaves if isinstance(v, torch.fx.Node) and v.op == "call_function"
            and v.target is operator.getitem}
    hop = next(iter(hops)) if len(hops) == 1 and len(leaves) == len(set(leaves)) else None
    if not isinstance(hop, torch.fx.Node) or not regions.is_region_call(hop) \
            or any(not isinstance(v, torch.fx.Node) or v.args[0] is not hop for v in leaves):
        raise CaptureError(f"Dynamo did not keep layer {layer!r} as a region (it traced it inline: a side effect "
                           "in its forward, or an argument it specializes on, such as a Python number)")
    return hop


def _indexed_only(node: torch.fx.Node, value: Any) -> None:
    if isinstance(value, (tuple, list)) and any(
            u.op != "call_function" or u.target is not operator.getitem or not isinstance(u.args[1], int)
            for u in node.users):
        raise CaptureError(f"{node.name} is used other than by indexing")


def _roles(hop: torch.fx.Node, exit_node: torch.fx.Node, path: str, fqn_of: dict[torch.fx.Node, str | None]
           ) -> tuple[list[tuple[str, Any]], Any, list[Any]]:
    flat, spec = _layer_args(exit_node, 2)
    where: dict[torch.fx.Node, int] = {}
    for i, a in enumerate(flat):
        if isinstance(a, torch.fx.Node):
            where.setdefault(a, i)
    roles: list[tuple[str, Any]] = []
    for op in hop.args[2:]:
        fqn = fqn_of.get(op) if isinstance(op, torch.fx.Node) else None
        if fqn is not None and fqn.startswith(path + "."):
            roles.append(("weight", fqn[len(path) + 1:]))
        elif isinstance(op, torch.fx.Node) and op in where:
            roles.append(("arg", where[op]))
        elif not isinstance(op, torch.fx.Node) or isinstance(op.meta.get("example_value"), torch.SymInt):
            roles.append(("shared", op))
        else:
            what = f"the weight {fqn!r} of another module" if fqn is not None else f"a tensor ({op.name})"
            raise CaptureError(f"layer {path!r} reads {what} from outside its arguments and weights")
    return roles, spec, [_meta(a) for a in flat]


def _weight_node(graph: torch.fx.Graph, after: torch.fx.Node, template: Any, fqn: str,
                 t: torch.Tensor) -> torch.fx.Node:
    """A placeholder for weight ``fqn`` after ``after``, typed and described as ``template`` (the
    same weight of a traced layer), its fake value made by the graph's fake mode."""
    with graph.inserting_after(after):
        node = graph.placeholder("aotc_" + fqn.replace(".", "_"), type_expr=template.type)
    node.meta = {k: v for k, v in template.meta.items() if k != "grapharg"}
    node.meta["example_value"] = template.meta["example_value"].fake_mode.from_tensor(t, static_shapes=True)
    return node


def _pattern(roles: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """What two traced layers must agree on: each operand's role, weight name and argument place;
    a size symbol may differ (the first layer's input may carry another symbol of the same size,
    as transformers' embeddings do): a called layer takes the second's, as Dynamo's reuse did."""
    return [("shared", "symbol") if r == "shared" and isinstance(w, torch.fx.Node) else (r, w) for r, w in roles]


def _checked_block(block: layer_calls.Block, differing: Mapping[int, frozenset[str]]) -> None:
    """What the trace itself told of each kind: every layer of it called in the same global
    state (grad mode, autocast); a kind with layers to stamp out called in a model that changes no
    state of its own between them (an attribute, a global, an outer list: Dynamo replays such a
    change after the graph, and a later layer may read it), and with a body that read none of
    the attributes its layers differ in (``differing``: their index, left out of the structure
    key — Dynamo guards it on the layers it traces, nothing does on a stamped one)."""
    for kind in {s.kind for s in block.slots if s.role != layer_calls.PLAIN}:
        slots = [n for n, s in enumerate(block.slots) if s.kind == kind]
        if len({block.ambient.get(n) for n in slots}) != 1:
            raise CaptureError("the layers of a kind are called under different grad or autocast modes")
        if any(block.slots[n].role == layer_calls.CALLED for n in slots):
            _unchanged_between([block.changed.get(n) for n in slots])
            read = block.read.get(kind)
            if read is None or read & differing.get(kind, frozenset()):
                raise CaptureError(f"a layer's body reads {sorted(differing.get(kind, ()))!r} or "
                                   "what it read is unknown: each layer traced")


def _unchanged_between(states: list[tuple[tuple[str, Any], ...] | None]) -> None:
    """Raise unless the model had changed the same state, to the same values, at each of a
    kind's layers' calls (:func:`aotc._torch.layer_calls._changed_state`)."""
    if any(s is None for s in states):
        raise CaptureError("what the model changes while it runs is unknown (this torch): each layer traced")
    first = dict(states[0] or ())
    for state in states[1:]:
        mine = dict(state or ())
        if mine != first:
            what = sorted(k for k in {*first, *mine} if first.get(k) != mine.get(k))[0]
            raise CaptureError(f"the model changes {what} between its layers (a later layer may read "
                               "it; a stamped layer would not see it): each layer traced")


def _no_alias(node: torch.fx.Node, skip: int) -> None:
    nodes = [a for a in _layer_args(node, skip)[0] if isinstance(a, torch.fx.Node)]
    if len(set(nodes)) != len(nodes):
        raise CaptureError("a layer is given the same tensor in two places (a body traced for it "
                           "would take one for the other at another layer)")


def stamp_out(captured: Captured, owner: torch.nn.Module, block: layer_calls.Block,
              differing: Mapping[int, frozenset[str]]) -> tuple[Captured, int]:
    """``captured`` with every ``layer_call`` node replaced by a region call (module doc), and
    how many were; raises :class:`CaptureError` (the graph untouched) where one may not be.
    ``differing``: per kind, the attributes its layers may differ in (:func:`_checked_block`)."""
    slots = block.slots
    gm, graph = captured.gm, captured.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fqn_of = {n: s.fqn for n, s in zip(placeholders, captured.arg_spec) if s.kind in ("param", "buffer")}
    node_of = {id(ex): n for n, ex in zip(placeholders, captured.example_inputs)}
    path_of = {id(m): p for p, m in owner.named_modules(remove_duplicate=False)}
    exits = {n.args[0]: n for n in graph.nodes if n.op == "call_function" and n.target is layer_calls.layer_exit}
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is layer_calls.layer_call]
    traced = [s for s in slots if s.role == layer_calls.TRACED]
    if len(exits) != len(traced) or len(calls) != sum(s.role == layer_calls.CALLED for s in slots):
        raise CaptureError("the trace did not call each layer once, in order")
    _checked_block(block, differing)
    for node in exits.values():
        _no_alias(node, 2)
    for node in calls:
        _no_alias(node, 1)

    kinds: dict[int, _Kind] = {}
    for n, s in enumerate(slots):
        if s.role != layer_calls.TRACED or s.position != 1:
            continue
        first, second = exits[n - 1], exits[n]
        hops = [_hop_of(first, path_of[id(slots[n - 1].module)]), _hop_of(second, path_of[id(s.module)])]
        if len({(str(getattr(h.args[0], "target", "")), h.args[1]) for h in hops}) != 1:
            raise CaptureError(f"Dynamo did not reuse the body of {type(s.module).__name__} for its "
                               "second layer (side effects, or its guards differ)")
        roles, spec, metas = _roles(hops[1], second, path_of[id(s.module)], fqn_of)
        if _pattern(_roles(hops[0], first, path_of[id(slots[n - 1].module)], fqn_of)[0]) != _pattern(roles):
            raise CaptureError(f"the two traced layers of {type(s.module).__name__} pass their operands differently")
        kinds[s.kind] = _Kind(hops[1], second, roles, spec, metas)

    plans = []
    for c in calls:
        s = slots[int(c.args[0])]
        kind = kinds[s.kind]
        flat, spec = _layer_args(c, 1)
        if spec != kind.spec or [_meta(a) for a in flat] != kind.metas:
            raise CaptureError(f"layer {path_of[id(s.module)]!r} is called with other arguments than "
                               "the traced layers of its kind")
        _indexed_only(c, kind.exit.args[1])
        plans.append((c, s, kind))
    for e in exits.values():
        _indexed_only(e, e.args[1])

    new_weights: list[tuple[str, str, torch.Tensor]] = []
    last = placeholders[-1]
    for c, s, kind in plans:
        flat = _layer_args(c, 1)[0]  # read now: an earlier call's outputs were just replaced
        path = path_of[id(s.module)]
        tensors = {**dict(s.module.named_buffers(remove_duplicate=False)),
                   **dict(s.module.named_parameters(remove_duplicate=False))}
        operands = []
        for (role, what), template in zip(kind.roles, kind.hop.args[2:]):
            if role == "arg":
                operands.append(flat[what])
            elif role == "shared":
                operands.append(what)
            else:
                t = tensors[what]
                if id(t) not in node_of:
                    last = node_of[id(t)] = _weight_node(graph, last, template, f"{path}.{what}", t)
                    kind_name = "param" if isinstance(t, torch.nn.Parameter) else "buffer"
                    new_weights.append((kind_name, f"{path}.{what}", t))
                operands.append(node_of[id(t)])
        with graph.inserting_before(c):
            hop = graph.call_function(regions.invoke_subgraph(), (kind.hop.args[0], kind.hop.args[1], *operands))
            hop.meta = dict(kind.hop.meta)
            items = {}
            for user in kind.hop.users:
                items[user] = graph.call_function(operator.getitem, (hop, user.args[1]))
                items[user].meta = dict(user.meta)
        _out_map(c, pytree.tree_map(items.__getitem__, kind.exit.args[1]))
    for e in exits.values():
        _out_map(e, e.args[1])
    graph.lint()
    gm.recompile()
    return dataclasses.replace(
        captured,
        example_inputs=(*captured.example_inputs, *(t for _, _, t in new_weights)),
        arg_spec=(*captured.arg_spec, *(ArgSlot(k, fqn=f) for k, f, _ in new_weights)),  # type: ignore[arg-type]
    ), len(plans)
