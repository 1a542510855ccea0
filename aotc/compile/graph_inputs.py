"""The graph Dynamo hands over, made flat before it is keyed and split: every nested compile
region inlined (attention sits inside a region's body, and the split must see it), and every
tensor the graph reads from its module (``get_attr``: an optimizer's parameters and state, a
constant Dynamo lifted) made a graph input, fed live at each call.

Why inputs: the stitching program only carries placeholders, pieces and their outputs, and a
stored program cannot hold the traced module's tensors; a tensor read by attribute (Adam's
``exp_avg``, updated in place at every step) is the caller's state, not a constant. Each such
tensor enters the key as an input does — dtype, shape, strides, device — never by value, and the
callable passes the very tensor objects the traced module holds (Dynamo re-traces when they are
replaced).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from aotc._torch import regions

__all__ = ["flat_graph"]


def flat_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
               ) -> tuple[torch.fx.GraphModule, list[Any], tuple[torch.Tensor, ...]]:
    """``(graph, example inputs, extra inputs)``: ``gm`` with its regions inlined (in place:
    the same computation) and, when it reads tensors by attribute, a new graph that takes them
    as inputs after the given ones (``extra inputs``: the live tensors, in that order; the
    caller appends them at every call). ``gm`` itself keeps its attributes."""
    regions.inline_regions(gm)
    values = {n: operator.attrgetter(str(n.target))(gm) for n in gm.graph.nodes if n.op == "get_attr"}
    lifted = [n for n, v in values.items() if isinstance(v, torch.Tensor)]
    if not lifted:
        return gm, list(example_inputs), ()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = list(gm.graph.nodes)
    last = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    for n in nodes[:last + 1]:
        env[n] = graph.node_copy(n, lambda a: env[a])
    for n in lifted:
        env[n] = graph.placeholder(f"attr_{str(n.target).replace('.', '_')}")
        env[n].meta = dict(n.meta)
    for n in nodes[last + 1:]:
        if n not in env:
            env[n] = graph.node_copy(n, lambda a: env[a])
    out = torch.fx.GraphModule(gm, graph)
    extra = tuple(values[n] for n in lifted)
    return out, [*example_inputs, *extra], extra
