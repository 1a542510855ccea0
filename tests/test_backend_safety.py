"""The backend's safety net: a kernel's failed check becomes a Python exception (the source
rewrite of ``aotc._torch.kernel_checks``), a graph aotc cannot serve falls back
(``AOTC_FALLBACK``), ``torch.compile``'s own ``mode=`` / ``options=`` are applied or refused in
one line, and a compile never moves a live model's state."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from aotc._torch.kernel_checks import guard_checks
from tests.conftest import aotc_warnings

_KERNEL = '''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const int64_t* in_ptr0, float* out_ptr0, const int64_t ks0)
{
    #pragma omp parallel
    {
        #pragma omp for
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(1L))
        {
            auto tmp0 = in_ptr0[static_cast<int64_t>(x0)];
            TORCH_CHECK((0 <= tmp0) & (tmp0 < 300L), "index out of bounds: 0 <= tmp0 < 300L");
            auto tmp1 = [&] { TORCH_CHECK(tmp0 < 7, "in a lambda"); return tmp0; }();
            out_ptr0[x0] = at::vec::vec_reduce_all<float, 1>([](float& x, float& y) { return x + y; }, tmp1);
        }
    }
    TORCH_CHECK(ks0 > 0, "outside any loop");
}
// Python bindings to call kernel():
static PyObject* kernel_py(PyObject* self, PyObject* args) { return nullptr; }
'''


def test_a_check_in_a_loop_notes_the_failure_and_the_kernel_throws_at_its_end() -> None:
    out = guard_checks(_KERNEL)
    assert out.count("\n") == _KERNEL.count("\n")  # every line where it was (errors name lines)
    assert 'TORCH_CHECK((0 <= tmp0)' not in out
    assert ('if (C10_UNLIKELY(!((0 <= tmp0) & (tmp0 < 300L)))) { const char* aotc_none = nullptr; '
            'aotc_check_failure.compare_exchange_strong(aotc_none, "index out of bounds: 0 <= '
            'tmp0 < 300L"); continue; }') in out
    assert 'TORCH_CHECK(tmp0 < 7, "in a lambda")' in out  # `continue` cannot leave a lambda
    assert 'TORCH_CHECK(ks0 > 0, "outside any loop")' in out  # thrown outside every region
    body_end = out.index("// Python bindings")
    assert out.rindex("throw std::runtime_error(aotc_what);", 0, body_end) > out.index("outside any loop")
    assert "std::atomic<const char*> aotc_check_failure{nullptr};" in out.split("\n")[3]
    assert guard_checks(out) == out or out.count("aotc_check_failure{nullptr}") == 1


@pytest.mark.parametrize("source", [
    _KERNEL.replace("    TORCH_CHECK(ks0 > 0", "    if (ks0 == 0) return;\n    TORCH_CHECK(ks0 > 0"),
    _KERNEL.replace('"index out of bounds: 0 <= tmp0 < 300L"', '"index ", tmp0'),
    "int main() { return 0; }",
])
def test_a_kernel_not_shaped_as_expected_is_left_as_inductor_wrote_it(source: str) -> None:
    out = guard_checks(source)
    if "return;" in source or "int main" in source:
        assert out == source
    else:
        assert '"index ", tmp0' in out and "TORCH_CHECK((0 <= tmp0)" in out


@pytest.mark.slow
def test_a_check_that_fails_in_a_parallel_region_raises_in_python(tmp_path: Path) -> None:
    """The rewritten kernel, built and run for real in a child process with 2 OpenMP threads:
    a bad index raises RuntimeError (Inductor's source aborts the child), the next call works."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent('''
        import sys, torch
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        from aotc._torch.kernel_checks import guard_checks
        src = open(sys.argv[1]).read().split("// Python bindings")[0]
        src = src.replace('auto tmp1 = [&] { TORCH_CHECK(tmp0 < 7, "in a lambda"); return tmp0; }();', "auto tmp1 = tmp0;")
        src = src.replace("out_ptr0[x0] = at::vec::vec_reduce_all<float, 1>([](float& x, float& y) { return x + y; }, tmp1);", "out_ptr0[x0] = tmp1;")
        if sys.argv[2] == "guarded":
            src = guard_checks(src)
        kernel = CppPythonBindingsCodeCache.load_pybinding(["const int64_t*", "float*", "const int64_t"], src)
        torch.set_num_threads(2)
        ids, out = torch.arange(64), torch.zeros(64)
        kernel(ids, out, 64)
        assert out[63] == 63
        ids[40] = 400
        try:
            kernel(ids, out, 64)
            print("no error")
        except RuntimeError as e:
            print("raised:", e)
        ids[40] = 1
        kernel(ids, out, 64)
        print("next call ok", int(out[40]))
    '''))
    src = tmp_path / "kernel.cpp"
    src.write_text(_KERNEL)
    from tests.conftest import PYTHON, python_env

    env = {**python_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    guarded = subprocess.run([PYTHON, str(script), str(src), "guarded"], capture_output=True,
                             text=True, env=env, timeout=300)
    assert guarded.returncode == 0, guarded.stderr[-2000:]
    assert "raised: index out of bounds: 0 <= tmp0 < 300L" in guarded.stdout
    assert "next call ok 1" in guarded.stdout
    raw = subprocess.run([PYTHON, str(script), str(src), "raw"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert raw.returncode != 0 and "terminate called" in raw.stderr  # what Inductor's source does


def test_torch_compile_modes_and_options_are_applied_or_refused_in_one_line() -> None:
    from aotc.backend.config import BackendConfig, call_config
    from aotc.errors import BackendError

    base = BackendConfig()
    assert call_config(base, {}) is base
    ro = call_config(base, {"mode": "reduce-overhead"})
    assert ro.graphs and ro.inductor == base.inductor
    tuned = call_config(base, {"mode": "max-autotune-no-cudagraphs"})
    assert tuned.inductor["max_autotune"] is True and not tuned.graphs
    assert call_config(base, {"mode": "default"}).inductor == base.inductor
    opts = call_config(base, {"options": {"compile_sizes": [4, 2], "cpp.simdlen": 256,
                                          "fallback": "eager"}})
    assert opts.compile_sizes == (2, 4) and opts.inductor["cpp.simdlen"] == 256
    assert opts.fallback == "eager"
    for kwargs, words in [({"mode": "fastest"}, "unknown mode 'fastest'; torch.compile's modes are"),
                          ({"options": {"stor": "/x"}}, "unknown option 'stor'"),
                          ({"options": {"fallback": "retry"}}, "expected one of inductor, eager, error"),
                          ({"dynamic": True}, "got dynamic=…; torch.compile passes only")]:
        with pytest.raises(BackendError, match=words) as e:
            call_config(base, kwargs)
        assert "\n" not in str(e.value)


def test_a_bad_fallback_setting_is_named() -> None:
    from aotc.backend.config import BackendConfig
    from aotc.errors import BackendError
    from aotc.settings import Settings

    assert BackendConfig().fallback_for(Settings()) == "inductor"
    assert BackendConfig().fallback_for(Settings.from_env({"AOTC_FALLBACK": "Eager"})) == "eager"
    with pytest.raises(BackendError, match="AOTC_FALLBACK='later': expected one of"):
        BackendConfig().fallback_for(Settings.from_env({"AOTC_FALLBACK": "later"}))


def _unkeyable_fn():
    def scale(x):  # a local function kept as a call in the graph: no stable name to key by
        return x * 3

    allowed = torch._dynamo.allow_in_graph(scale)
    return lambda x: allowed(torch.relu(x)) + 1


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["inductor", "eager", "error"])
def test_a_graph_aotc_cannot_key_falls_back_with_one_line(tmp_path: Path, caplog, policy: str) -> None:
    import aotc
    from aotc.counters import COUNTERS

    torch._dynamo.reset()
    before = COUNTERS.compiles
    fn = torch.compile(_unkeyable_fn(), backend=aotc.backend(store=str(tmp_path / "s"),
                                                             fallback=policy))
    x = torch.tensor([-1.0, 2.0])
    if policy == "error":
        with pytest.raises(Exception, match="no stable name"):
            fn(x)
        return
    assert torch.equal(fn(x), torch.tensor([1.0, 7.0]))
    lines = aotc_warnings(caplog)
    assert len(lines) == 1 and "not served by aotc (BackendError:" in lines[0], lines
    assert f"{policy} runs it instead" in lines[0] and "no stable name" in lines[0]
    assert COUNTERS.compiles == before


@pytest.mark.slow
def test_a_damaged_entry_falls_back_to_inductor_and_is_never_used(tmp_path: Path, caplog) -> None:
    import aotc
    from aotc.cache import Store

    store = tmp_path / "s"
    fn = lambda x: torch.sigmoid(x) * 2 + 1  # noqa: E731
    torch._dynamo.reset()
    first = aotc.backend(store=str(store))
    x = torch.randn(8)
    want = torch.compile(fn, backend=first)(x)
    key = first.last["key"]
    s = Store(store)
    try:
        entry = s.get(key, record=False)
        path = s.blob_path(entry.blobs["program"].digest)
    finally:
        s.close()
    path.chmod(0o644)
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"damaged")
    torch._dynamo.reset()
    caplog.clear()
    again = aotc.backend(store=str(store))
    assert torch.allclose(torch.compile(fn, backend=again)(x), want)
    lines = aotc_warnings(caplog)
    assert len(lines) == 1 and "not served by aotc" in lines[0] and key[:16] in lines[0], lines
    assert again.last["fallback"] == "inductor"


@pytest.mark.slow
def test_compiling_a_stateful_graph_moves_its_state_as_eager_does(tmp_path: Path) -> None:
    """The root cause of the generate() abort: the compile-time checks ran the graph on the
    live model's own step counter. A compile now leaves it as eager would."""
    import aotc
    from tests.fixtures.client_models import GptFastDecoder

    torch._dynamo.reset()
    ref, model = GptFastDecoder(), GptFastDecoder()
    step = torch.compile(model, backend=aotc.backend(store=str(tmp_path / "s"), fallback="error"))
    with torch.no_grad():
        for i in range(3):
            ids, pos = torch.tensor([[5 + i]]), torch.tensor([i])
            assert torch.allclose(step(ids, pos), ref(ids, pos), atol=1e-4)
    assert int(model.steps) == int(ref.steps) == 3
    assert torch.equal(model.k_cache, ref.k_cache) or torch.allclose(model.k_cache, ref.k_cache, atol=1e-5)


@pytest.mark.slow
def test_a_failed_numeric_check_falls_back_and_stores_nothing(tmp_path: Path, caplog) -> None:
    """Random numbers drawn in the graph: the compiled program cannot agree with the graph run
    eagerly, so nothing is stored and Inductor serves the graph."""
    import aotc
    from aotc.cache import Store

    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + torch.randn_like(x), backend=aotc.backend(store=str(tmp_path / "s")))
    assert fn(torch.zeros(64)).shape == (64,)
    lines = aotc_warnings(caplog)
    assert len(lines) == 1 and "not served by aotc (NumericMismatchError:" in lines[0], lines
    s = Store(tmp_path / "s")
    try:
        assert s.keys() == []
    finally:
        s.close()


def test_a_piece_gets_its_inputs_in_the_layout_it_was_compiled_for() -> None:
    """Phi-3's case: the piece was compiled for a contiguous [1, 4, 5, 16] and the attention
    op hands it the same values laid out [1, 5, 4, 16]-first: the piece gets a dense copy in
    its own layout; a tensor already in it (or differing only in a size-1 dim) passes as is."""
    from aotc.runtime.stitched import in_layouts

    memo: dict = {}
    layouts = [(0, (0, 1, 2, 3)), (2, (0, 1, 2, 3))]
    transposed = torch.randn(1, 5, 4, 16).transpose(1, 2)
    fine = torch.randn(1, 4, 5, 16)
    weight = torch.randn(16, 16).t()  # no layout recorded: the caller's own stands
    out = in_layouts((transposed, weight, fine), layouts, memo)
    assert out[0].stride() == (320, 80, 16, 1) and torch.equal(out[0], transposed)
    assert out[1] is weight and out[2] is fine
    one = torch.randn(2, 1, 8).as_strided((2, 1, 8), (8, 999, 1))
    assert in_layouts((one,), [(0, (0, 1, 2))], memo)[0] is one
    args = (fine, weight, fine)
    assert in_layouts(args, layouts, memo) is args  # nothing copied: the same tuple back
    dense = torch.randn(3, 4, 5)  # contiguous, but the piece wants dim 1 innermost
    moved = in_layouts((dense,), [(0, (0, 2, 1))], memo)[0]
    assert moved is not dense and moved.stride() == (20, 1, 4) and torch.equal(moved, dense)


def test_a_process_that_configures_no_logging_sees_aotc_warnings_only(tmp_path: Path) -> None:
    """The library prints nothing itself: in a fresh process that configures no logging, a
    fallback's warning still reaches stderr (Python's last resort, one line), the per-graph INFO
    line does not — until the operator asks with ``AOTC_LOG=info``."""
    from tests.conftest import PYTHON, python_env

    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import torch, aotc
        sys.path.insert(0, sys.argv[2])
        from tests.test_backend_safety import _unkeyable_fn
        backend = aotc.backend(store=sys.argv[1])
        torch.compile(_unkeyable_fn(), backend=backend)(torch.ones(2))
        print("--- AOTC_LOG=info", file=sys.stderr, flush=True)
        os.environ["AOTC_LOG"] = "info"
        torch.compile(lambda x: torch.relu(x) * 2, backend=backend)(torch.ones(3))
    """))
    env = {k: v for k, v in python_env().items() if k not in ("AOTC_LOG", "AOTC_PROGRESS")}
    done = subprocess.run([PYTHON, str(script), str(tmp_path / "s"), str(Path(__file__).parents[1])],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stderr.split("--- AOTC_LOG=info")
    quiet = [ln for ln in before.splitlines() if ln.startswith("aotc:")]
    assert len(quiet) == 1 and "not served by aotc (BackendError:" in quiet[0], before[-2000:]
    told = [ln for ln in after.splitlines() if ln.startswith("aotc:")]
    assert any(ln.startswith("aotc: graph ") and " miss: compiled " in ln for ln in told), after[-2000:]
    assert "[" in after and "] split:" in after  # progress lines at INFO too


def test_a_numeric_report_of_no_size_raises() -> None:
    """A check that compared nothing proves nothing: nothing is stored on its word."""
    from aotc.errors import NumericMismatchError
    from aotc.runtime.checking import Comparison, NumericReport

    with pytest.raises(NumericMismatchError, match="ran at no size.*nothing was stored"):
        NumericReport(1e-3, 1e-3).finish("compiled graph differs from the graph run eagerly", "fix it")
    report = NumericReport(1e-3, 1e-3)
    report.add("4", Comparison(max_abs_err=1e-6))
    assert report.finish("differs", "fix")["sizes"] == {"4": {"max_abs_err": 1e-6, "max_rel_err": 0.0}}


class _Embedder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(self.embed(ids))) * 2


def test_inputs_above_the_traced_size_repeat_the_example() -> None:
    """The check's inputs at a size above the traced one: each token dim grown by repeating the
    traced example (token ids stay in the vocabulary), laid out as the graph says; an input with
    nothing to repeat cannot be made."""
    from aotc.backend import build

    seen: dict = {}

    def record(gm, example_inputs):
        seen.update(gm=gm, inputs=list(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    model = _Embedder()
    ids = torch.tensor([3, 49, 0, 7, 12])
    torch._dynamo.mark_dynamic(ids, 0)
    torch.compile(model, backend=record, fullgraph=True)(ids)
    base = build._concrete_inputs(seen["gm"], seen["inputs"])
    assert build._traced_size(seen["gm"], base) == 5
    for n in (2, 5, 12):
        made = build._at_size(seen["gm"], base, n)
        assert made is not None
        grown = [x for x in made if isinstance(x, torch.Tensor) and x.dtype == torch.int64]
        assert len(grown) == 1 and torch.equal(grown[0], ids.repeat(3)[:n])
        assert any(type(x) is int and x == n for x in made)  # the size symbol
    assert build._checkable(seen["gm"], seen["inputs"], [2, 12]) == ([2, 12], [])
    assert build._input_at(torch.empty(0, 3), [4, 3], [3, 1]) is None
    assert build._input_at(torch.arange(6.0).reshape(2, 3), [5, 3], [1, 5]).stride() == (1, 5)


@pytest.mark.slow
def test_compile_sizes_above_the_traced_size_are_checked(tmp_path: Path) -> None:
    """Every stored static artifact is checked: compile sizes above the size Dynamo traced at
    are in the entry's numeric report (they were stored unchecked)."""
    import aotc
    from aotc.cache import Store

    torch._dynamo.reset()
    model = _Embedder()
    backend = aotc.backend(store=str(tmp_path / "s"), compile_sizes=[2, 16], fallback="error")
    fn = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.tensor([3, 49, 0, 7, 12])
    torch._dynamo.mark_dynamic(ids, 0)
    with torch.no_grad():
        torch.testing.assert_close(fn(ids), model(ids))
    assert backend.last["hit"] is False
    checked = set(backend.last["numerics"]["sizes"])
    assert {"2", "5", "16"} <= checked, checked
    s = Store(tmp_path / "s")
    try:
        assert set(s.get(backend.last["key"], record=False).metadata["numerics"]["sizes"]) == checked
    finally:
        s.close()
    big = torch.randint(0, 50, (16,))
    with torch.no_grad():
        torch.testing.assert_close(fn(big), model(big))
