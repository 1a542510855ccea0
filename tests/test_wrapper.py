"""The warm start's fast path (aotc._torch.wrapper): what qualifies, and that it is exact or refused."""

from __future__ import annotations

import shutil

import pytest
import torch

from aotc._torch import inductor_compile

from aotc._torch import inductor_load

from aotc._torch import wrapper
from tests.fixtures.small_graphs import mutating_graph, sigmoid_times_three_graph

HEADER = "import torch\nfrom torch._inductor.async_compile import AsyncCompile\n"


@pytest.mark.parametrize("body,reason", [
    ("from torch._inductor.runtime import triton_heuristics\n", "imports triton_heuristics"),
    ("import triton\n", "imports triton"),
    ("x = torch._inductor.config\n", "uses torch._inductor"),
    ("async_compile = AsyncCompile()\nk = async_compile.triton('k', 'src')\n",
     "async_compile.triton"),
    ("def call(args):\n    torch._dynamo.reset()\n", "uses torch._dynamo"),
    ("from torch._inductor.select_algorithm import AlgorithmSelectorCache\n",
     "AlgorithmSelectorCache"),
    ("if True:\n    from torch._inductor.runtime import triton_heuristics\n", "triton_heuristics"),
], ids=["runtime-import", "triton", "inductor-attr", "triton-kernel", "dynamo-in-call", "autotune",
        "import-under-other-if"])
def test_wrappers_needing_more_of_inductor_are_refused(body, reason) -> None:
    with pytest.raises(wrapper.Unsupported, match=reason):
        wrapper._check_ast(HEADER + body)


def test_benchmark_helpers_and_main_block_are_ignored() -> None:
    src = (HEADER + "def get_args():\n    from torch._dynamo.testing import rand_strided\n"
           "def benchmark_compiled_module():\n    from torch._inductor.utils import print_performance\n"
           "if __name__ == '__main__':\n    from torch._inductor.wrapper_benchmark import x\n"
           "def call(args):\n    return (extern_kernels.mm(args[0], args[1]),)\n")
    assert wrapper._check_ast(src) == ["mm"]


def test_record_round_trip_and_bad_records() -> None:
    code = wrapper.WrapperCode("def call(args): pass\n", {"ab" * 32: "x/y.so"}, {"mm": "torch.mm"})
    assert wrapper.WrapperCode.from_json(code.to_json()) == code
    with pytest.raises(ValueError, match="format"):
        wrapper.WrapperCode.from_json(b'{"format": 99}')


@pytest.mark.slow
def test_fast_path_is_exact_or_refused_for_an_input_mutation(tmp_path) -> None:
    """A piece that mutates an input must leave the input exactly as Inductor's artifact does —
    or not get the fast path at all (the compile-time equality check refuses it)."""
    g = torch.Generator().manual_seed(0)
    x, buf = torch.randn(6, 8, generator=g), torch.zeros(8)
    gm = mutating_graph()
    cp = inductor_compile.compile_piece(gm, [x, buf.clone()], 6, tmp_path / "p")
    root = tmp_path / "kernels"
    shutil.copytree(cp.kernel_root, root)
    slow = inductor_load.load_piece(cp.artifact, root)
    b_slow = buf.clone()
    with torch.no_grad():
        want = slow(x, b_slow)
    if cp.wrapper is None:
        assert cp.wrapper_note  # refused, with a reason
        return
    fast = wrapper.load(wrapper.WrapperCode.from_json(cp.wrapper.read_bytes()), root)
    b_fast = buf.clone()
    with torch.no_grad():
        got = fast(x, b_fast)
    assert wrapper.same_outputs(got, want) and torch.equal(b_fast, b_slow)


@pytest.mark.slow
def test_a_kernel_not_recorded_is_refused_at_load(tmp_path) -> None:
    x = torch.randn(4, 8)
    gm = sigmoid_times_three_graph()
    cp = inductor_compile.compile_piece(gm, [x], 4, tmp_path / "p")
    assert cp.wrapper is not None, cp.wrapper_note
    code = wrapper.WrapperCode.from_json(cp.wrapper.read_bytes())
    forged = wrapper.WrapperCode(code.source.replace("* 3", "* 4").replace("3.0", "4.0"),
                                 code.kernels, code.externs)
    assert forged.source != code.source  # the kernel source changed: its digest is unknown
    with pytest.raises(ImportError, match="not recorded"):
        wrapper.load(forged, cp.kernel_root)
    assert torch.equal(wrapper.load(code, cp.kernel_root)(x)[0], torch.sigmoid(x) * 3)
