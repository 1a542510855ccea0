"""The warm start's fast path (aotc._torch.wrapper): what qualifies, and that it is exact or refused."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from aotc._torch import inductor_compile, inductor_load, static_inputs, wrapper
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_bit_for_bit_means_bits_nan_is_not_zero_and_inf_is_not_the_largest_float(dtype) -> None:
    """The fast path is recorded only when it returns exactly what Inductor's artifact does:
    a NaN where Inductor has 0, +inf where it has the largest float, -0.0 where it has 0.0
    are differences (``nan_to_num`` hid the first two)."""
    big = torch.finfo(dtype).max
    want = torch.tensor([1.0, float("nan"), float("inf"), 0.0], dtype=dtype)
    assert wrapper.same_outputs([want], [want.clone()])  # the same NaN is the same bits
    for i, value in [(1, 0.0), (2, big), (3, -0.0)]:
        got = want.clone()
        got[i] = value
        assert not wrapper.same_outputs([want], [got]), (i, value)
        assert not wrapper.same_outputs([got], [want]), (i, value)
    scalar_nan, scalar_zero = torch.tensor(float("nan"), dtype=dtype), torch.tensor(0.0, dtype=dtype)
    assert wrapper.same_outputs([scalar_nan], [scalar_nan.clone()])  # 0-dim
    assert not wrapper.same_outputs([scalar_nan], [scalar_zero])
    grid = torch.arange(12, dtype=dtype).reshape(3, 4)
    grid[1, 2] = float("nan")
    view, other = grid.t(), grid.clone().t()  # non-contiguous, same strides
    assert wrapper.same_outputs([view], [other])
    other[2, 1] = 0.0
    assert not wrapper.same_outputs([view], [other])
    assert wrapper.same_outputs([want], [torch.zeros(4, dtype=dtype)], undefined=frozenset({0}))


def test_bit_for_bit_for_bool_int_and_complex() -> None:
    b = torch.tensor([True, False, True])
    assert wrapper.same_outputs([b], [b.clone()]) and not wrapper.same_outputs([b], [~b])
    i = torch.tensor([[1, -2], [3, 4]], dtype=torch.int64)
    assert wrapper.same_outputs([i, 7], [i.clone(), 7]) and not wrapper.same_outputs([i], [i + 1])
    assert wrapper.same_bits(torch.tensor(5, dtype=torch.uint8), torch.tensor(5, dtype=torch.uint8))
    c = torch.tensor([1 + 2j, complex(float("nan"), 0)])
    assert wrapper.same_outputs([c], [c.clone()])
    assert not wrapper.same_outputs([c], [torch.tensor([1 + 2j, 0j])])
    assert not wrapper.same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


@pytest.mark.slow
def test_a_static_size_compile_takes_a_subclass_weight_as_it_is(tmp_path) -> None:
    # a piece compiled for a static size is given inputs made for that size; a tensor-subclass
    # weight (torchao's int8) made anew from its outer shape would be a plain tensor, and the code
    # compiled for it read the subclass's unallocated storage at run time ("data is not allocated")
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False)).eval()
    quantize_(lin, Int8WeightOnlyConfig())
    w = lin[0].weight
    assert type(w) is not torch.nn.Parameter and hasattr(w, "__tensor_flatten__"), type(w)
    made = inductor_compile.static_example_inputs([torch.randn(4, 32), w], 4)
    assert made[1] is w and made[0].shape == (4, 32)
    # the manifest door's trace hands over fake weights: rebuilt as real ones of the same kind
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(w)
    (rebuilt,) = inductor_compile.static_example_inputs([fake], 4)
    assert type(rebuilt) is type(w) and rebuilt.shape == w.shape and not static_inputs.is_fake(rebuilt)
    assert static_inputs.is_fake(fake)

    gm = torch.fx.symbolic_trace(lambda x, w: (torch.nn.functional.linear(x, w),))
    x = torch.randn(4, 32)
    cp = inductor_compile.compile_piece(gm, [x, w], 4, tmp_path / "p")
    with torch.no_grad():
        got = inductor_load.load_piece(cp.artifact, cp.kernel_root)(x, w)[0]
        want = lin(x)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


_INT8_CHECK = """
import sys, torch, aotc
from aotc.manifest import load_manifest
from aotc.model.build import make_named_inputs
runner = aotc.load(sys.argv[1], store=sys.argv[2])
for n in (4, 5):  # the static artifact, the dynamic one
    kw = make_named_inputs(load_manifest(sys.argv[1]), n, seed=n)
    with torch.no_grad():
        got, want = runner(**kw), runner.eager(**kw)
    assert torch.allclose(got, want, atol=1e-4), (n, (got - want).abs().max())
print("served")
"""


@pytest.mark.slow
def test_torchao_int8_through_the_manifest_door_with_a_compile_size(tmp_path) -> None:
    # a client: torchao's int8 weights (fake in the manifest door's trace) compiled for the
    # dynamic shape and a static size, checked, then loaded and served at both in a fresh
    # process (each its own: quantize_ sets Inductor options process-wide)
    pytest.importorskip("torchao")
    import yaml

    from tests.conftest import AOTC_CLI, PYTHON, python_env

    data = {"name": "int8-llama", "model": {"factory": "tests.fixtures.more_client_models:int8_llama",
                                            "kwargs": {"layers": 2}, "output": "logits"},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": [1, "tokens"], "high": 256}],
            "compile_sizes": [4], "max_tokens": 64,
            "splitting_ops": ["aten::scaled_dot_product_attention"]}
    path = tmp_path / "int8.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {**python_env(), "AOTC_STORE": str(tmp_path / "store")}
    res = subprocess.run([*AOTC_CLI, "compile", str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loads through Inductor" not in res.stderr, "a piece lost the fast path"
    res = subprocess.run([PYTHON, "-c", _INT8_CHECK, str(path), str(tmp_path / "store")], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0 and "served" in res.stdout, res.stderr[-3000:]
