"""The stored graph format runs the same two ways: the written-out Python function (every value
deleted after its last use) and the node-by-node interpreter it falls back to."""

from __future__ import annotations

import operator

import torch

from aotc.records.graphcode import GraphProgram, encode_graph


class _Stitchlike(torch.nn.Module):
    """Ops, methods, getitems, slices, dtypes, keyword arguments, a value used twice, one
    returned and used later, and a constant float."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        a = torch.ops.aten.relu.default(x) + y
        b = a.view(-1)
        c = torch.ops.aten.mul.Tensor(b, 2.5)
        pair = (c, b)
        first = operator.getitem(pair, 0)
        return first[1:3], b.to(torch.float64), c.sum(dim=0, keepdim=True), a


def test_the_written_out_function_and_the_interpreter_agree() -> None:
    gm = torch.fx.symbolic_trace(_Stitchlike())
    program = GraphProgram(encode_graph(gm))
    assert program._compiled is not None  # the fast form is the one that runs
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    want = _Stitchlike()(x, y)
    fast = program({}, x, y)
    program._compiled = None
    slow = program({}, x, y)
    for got in (fast, slow):
        assert isinstance(got, tuple) and len(got) == len(want) == 4
        assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))


def test_a_graph_the_writer_does_not_know_runs_through_the_interpreter() -> None:
    gm = torch.fx.symbolic_trace(_Stitchlike())
    encoded = encode_graph(gm)
    for n in encoded["nodes"]:
        if n.get("target", "").startswith("method:"):
            n["target"] = "method:not an identifier"  # the writer refuses; the interpreter fails at call
    program = GraphProgram(encoded)
    assert program._compiled is None


def test_graphs_alike_but_for_names_are_decoded_once() -> None:
    """One attention piece per layer differs from the next only in its node names: decoded
    once (``decoded``); a graph with another constant is decoded on its own, and each runs
    as it was written."""
    from aotc.records.graphcode import decoded

    def encoded(name: str, scale: float) -> dict:
        g = torch.fx.Graph()
        x = g.placeholder(f"x_{name}")
        m = g.call_function(torch.ops.aten.mul.Tensor, (x, scale), name=f"mul_{name}")
        g.output((m,))
        return encode_graph(torch.fx.GraphModule(torch.nn.Module(), g))

    a, b, c = encoded("3", 2.0), encoded("17", 2.0), encoded("4", 3.0)
    assert a != b  # the records differ (names)
    assert decoded(a) is decoded(b)
    assert decoded(c) is not decoded(a)
    x = torch.randn(4)
    assert torch.equal(decoded(b)[0]({}, x)[0], x * 2.0)
    assert torch.equal(decoded(c)[0]({}, x)[0], x * 3.0)
    assert torch.equal(decoded(c)[1].fn(x)[0], x * 3.0)
