"""A piece's fast-path check copies only what the piece may write: the weights it reads are
shared (at 0.5B the embedding alone is 545 MB, copied twice a cold compile took 1.3x eager's
memory). No compile here: the graphs are traced by FX."""

from __future__ import annotations

import torch
import torch.fx

from aotc._torch.ops import written_inputs
from aotc._torch.wrapper import _clone, check_values


def _gm(fn) -> torch.fx.GraphModule:  # type: ignore[no-untyped-def]
    return torch.fx.symbolic_trace(fn)


def test_a_piece_that_only_reads_writes_nothing() -> None:
    def f(x, w, b):  # type: ignore[no-untyped-def]
        return torch.nn.functional.linear(x, w, b).relu()

    assert written_inputs(_gm(f)) == frozenset()


def test_a_cache_written_through_a_view_is_written_and_its_sources_are_not() -> None:
    def f(x, w, cache, pos):  # type: ignore[no-untyped-def]
        k = x @ w
        cache.view(-1, 4).index_copy_(0, pos, k)  # the destination is a view of a placeholder
        return k

    assert written_inputs(_gm(f)) == frozenset({2})


def test_item_assignment_and_in_place_methods_count() -> None:
    import operator

    g = torch.fx.Graph()
    x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
    g.call_function(operator.setitem, (x, 0, 1.0))
    g.call_method("mul_", (y, 2))
    g.output(g.call_function(operator.add, (z, 1)))
    assert written_inputs(torch.fx.GraphModule(torch.nn.Module(), g)) == frozenset({0, 1})


def test_aten_ops_with_write_annotations_count() -> None:
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    c = g.call_function(torch.ops.aten.add_.Tensor, (a, b))
    g.output(c)
    assert written_inputs(torch.fx.GraphModule(torch.nn.Module(), g)) == frozenset({0})


def test_read_only_parameters_are_shared_and_the_rest_copied() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    written = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    cache, x = torch.zeros(4), torch.randn(2, 8)
    values = check_values([x, w, written, cache], read_only=frozenset({0, 1}))
    assert values[1] is w  # a parameter the piece only reads: not copied
    assert values[2] is not written and values[3] is not cache and values[0] is not x
    mine = _clone(values, frozenset({0, 1}))
    assert mine[1] is w and mine[0] is not values[0] and mine[2] is not values[2]
    # without the piece's word, nothing of the caller's is passed
    assert all(v is not o for v, o in zip(check_values([x, w]), [x, w]))


def test_a_large_read_only_plain_tensor_is_shared_a_small_one_randomized() -> None:
    big, small = torch.zeros(1 << 18), torch.zeros(16)  # 1 MiB and 64 bytes, read only
    values = check_values([big, small], read_only=frozenset({0, 1}))
    assert values[0] is big  # a weight the manifest's capture passes as a plain tensor
    assert values[1] is not small and bool(values[1].abs().sum() > 0)  # random, not zeros
