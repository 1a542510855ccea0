"""Keys for every graph Inductor compiles, and failures remembered (issue 32).

The key side runs Dynamo with a backend that only keys (no compile): ``boolean_dispatch``
functions (``F.max_pool2d``), a slice whose bound is a node of the graph (a BERT's
``position_ids[:, :n]``), ``torch.cond`` with its branch bodies, tensor-subclass inputs by type,
flatten context and inner tensors, the closures of functions a graph calls, and a graph's
computed dtype (the check's tolerance). Never a collision: each pair below differs only in what
changes the result, and gets two keys. The failure side runs real subprocesses: a graph whose
check fails is recorded, the next process falls back at once naming the reason, ``aotc inspect
cache`` lists it and ``aotc gc`` forgets it; no work directory stays behind."""

from __future__ import annotations

import functools
import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import PYTHON, python_env, run_cli


def _keys(fn, *args, dynamic: bool | None = None) -> list[str]:
    """The backend keys of the graphs Dynamo makes of ``fn(*args)`` (nothing compiled)."""
    from aotc.backend.serve import backend_key

    keys: list[str] = []

    def keyer(gm, example_inputs):
        keys.append(backend_key(gm, example_inputs)[0])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=keyer, dynamic=dynamic, fullgraph=True)(*args)
    torch._dynamo.reset()
    return keys


def test_max_pool_through_boolean_dispatch_is_keyed_by_its_module_name() -> None:
    from aotc._torch.ops import stable_name

    assert stable_name(F.max_pool2d) == "torch.nn.functional.max_pool2d"
    x = torch.randn(1, 2, 8, 8)
    two = _keys(lambda t: F.max_pool2d(t, 2), x)
    three = _keys(lambda t: F.max_pool2d(t, 3), x)
    assert len(two) == 1 and two != three
    assert two == _keys(lambda t: F.max_pool2d(t, 2), x)  # the same graph, the same key


def test_a_slice_bounded_by_a_graph_value_is_keyed() -> None:
    table = torch.arange(64).reshape(1, 64)

    def f(ids):  # transformers' position_ids[:, :seq_len] with seq_len from the input
        return ids + table[:, : ids.shape[1]]

    def g(ids):
        return ids + table[:, 1 : ids.shape[1] + 1]

    ids = torch.zeros(1, 7, dtype=torch.int64)
    torch._dynamo.mark_dynamic(ids, 1)
    first = _keys(f, ids)
    torch._dynamo.mark_dynamic(ids, 1)
    assert len(first) == 1 and first != _keys(g, ids)


def test_cond_branches_enter_the_key() -> None:
    x = torch.randn(4)
    relu = _keys(lambda t: torch.cond(t.sum() > 0, lambda u: u.relu(), lambda u: u * 2, (t,)), x)
    sigmoid = _keys(lambda t: torch.cond(t.sum() > 0, lambda u: u.sigmoid(), lambda u: u * 2, (t,)), x)
    three = _keys(lambda t: torch.cond(t.sum() > 0, lambda u: u.relu(), lambda u: u * 3, (t,)), x)
    assert len({*relu, *sigmoid, *three}) == 3


@torch._dynamo.allow_in_graph
def _scaled(x, k):  # a module function kept as a call in the graph
    return x * k


_HALF, _DOUBLE = functools.partial(_scaled, k=0.5), functools.partial(_scaled, k=2.0)


def test_a_function_in_the_graph_is_keyed_with_its_bound_values() -> None:
    x = torch.randn(4)
    half = _keys(lambda t: _HALF(t), x)
    double = _keys(lambda t: _DOUBLE(t), x)
    assert half and half != double


class _Scaled(torch.Tensor):
    """A minimal tensor subclass (a quantized weight's shape): ``data`` times a scale tensor,
    with a flag in its flatten context."""

    @staticmethod
    def __new__(cls, data, scale, transposed=False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32)

    def __init__(self, data, scale, transposed=False):
        self.data_, self.scale, self.transposed = data, scale, transposed

    def __tensor_flatten__(self):
        return ["data_", "scale"], {"transposed": self.transposed}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return _Scaled(inner["data_"], inner["scale"], ctx["transposed"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a.data_.float() * a.scale if isinstance(a, _Scaled) else a
        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in (kwargs or {}).items()})


def test_a_tensor_subclass_input_is_keyed_by_type_context_and_inner_tensors() -> None:
    from aotc.backend.graphkey import graph_signature

    def sig(w):
        seen = []

        def keyer(gm, ex):
            seen.append(graph_signature(gm, ex))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(lambda x: x + w, backend=keyer, fullgraph=True)(torch.ones(4))
        return seen

    data = torch.randint(-8, 8, (4,), dtype=torch.int8)
    one = sig(_Scaled(data, torch.tensor(0.5)))
    other_scale = sig(_Scaled(data, torch.tensor(0.25)))
    flag = sig(_Scaled(data, torch.tensor(0.5), transposed=True))
    wider = sig(_Scaled(data.to(torch.int16), torch.tensor(0.5)))
    subs = [line[1] for line in one[0]["lines"] if line[0] == "placeholder" and "subclass" in line[1]]
    if not subs:  # Dynamo may have inlined the subclass as a constant: its digest keys it
        pytest.skip("this torch lifts no subclass input")
    sub = subs[0]["subclass"]
    assert sub["type"].endswith("_Scaled") and set(sub["inner"]) == {"data_", "scale"}
    assert one == other_scale  # the scale's value is an input, bound at call time
    assert one != flag and one != wider


def test_the_check_judges_a_graph_by_the_dtype_it_computes_in() -> None:
    from aotc.backend.build import computed_float_dtype
    from aotc.backend.config import BackendConfig

    seen = []

    def keyer(gm, ex):
        seen.append(computed_float_dtype(gm, ex))
        return gm.forward

    lin = torch.nn.Linear(8, 8)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(lin, backend=keyer)(torch.randn(2, 8))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lin, backend=keyer)(torch.randn(2, 8))
        torch.compile(lin.half(), backend=keyer)(torch.randn(2, 8).half())
    torch._dynamo.reset()
    assert seen == [torch.bfloat16, torch.float32, torch.float16]
    cfg = BackendConfig()
    assert [cfg.tolerance_for(d) for d in seen] == [(3e-2, 3e-2), (1e-4, 1e-4), (1e-2, 1e-2)]


_FAILING = textwrap.dedent("""
    import sys, time, json, torch
    from aotc.counters import COUNTERS

    def f(x):
        return x + torch.randn_like(x)  # random: never equal to the graph run eagerly

    t = time.perf_counter()
    with torch.no_grad():
        out = torch.compile(f, backend="aotc")(torch.zeros(64))
    print(json.dumps({"compiles": COUNTERS.compiles, "seconds": time.perf_counter() - t,
                      "shape": list(out.shape)}))
""")


def _failing_run(tmp_path: Path, store: Path, policy: str = "eager") -> tuple[dict, str]:
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    env = {**python_env(), "AOTC_STORE": str(store), "AOTC_FALLBACK": policy}
    res = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, env=env, timeout=300)
    if policy == "error":
        return {"rc": res.returncode}, res.stderr
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.slow
def test_a_graph_aotc_gave_up_on_is_remembered_until_gc(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first, err1 = _failing_run(tmp_path, store)
    assert first["compiles"] >= 1 and "NumericMismatchError" in err1
    assert not list((store / "store-v1" / "tmp").glob("compile-*"))  # no work dir left behind
    second, err2 = _failing_run(tmp_path, store)
    lines = [ln for ln in err2.splitlines() if ln.startswith("aotc:")]
    assert second["compiles"] == 0, err2[-2000:]  # no split, compile or check
    assert len(lines) == 1 and "gave up on this graph before (1 try" in lines[0], lines
    assert "NumericMismatchError" in lines[0] and "`aotc gc` forgets it" in lines[0]

    listed = json.loads(run_cli("--store", str(store), "inspect", "cache", "--json").stdout)
    assert [f["tries"] for f in listed["failures"]] == [1]
    assert listed["failures"][0]["reason"].startswith("NumericMismatchError")
    table = run_cli("--store", str(store), "inspect", "cache").stdout
    assert "given up on (1;" in table and "1 given up" in table
    gc = run_cli("--store", str(store), "gc").stdout
    assert "forgot 1 remembered failures" in gc
    # forgotten: the next process tries again (raise_if_given_up finds nothing to raise)
    assert json.loads(run_cli("--store", str(store), "inspect", "cache", "--json").stdout)["failures"] == []


def test_failures_are_kept_per_aotc_version(tmp_path: Path) -> None:
    from aotc.cache import Store, failures

    store = Store(tmp_path / "s")
    assert failures.remember(store, "k" * 64, "m", "v1", "CompileError:  two\nlines")
    assert failures.remember(store, "k" * 64, "m", "v1", "CompileError: again")
    assert failures.lookup(store, "k" * 64, "v2") is None  # another aotc tries again
    found = failures.lookup(store, "k" * 64, "v1")
    assert found is not None and found.tries == 2 and found.reason == "CompileError: again"
    assert failures.forget(store, "k" * 64) and failures.lookup(store, "k" * 64, "v1") is None



_FACTOR = 2.0


@torch._dynamo.allow_in_graph
def _times_factor(x, k=1.0):  # reads a module global and has a default: both shape the graph
    return x * _FACTOR * k


def test_a_function_in_the_graph_is_keyed_with_the_globals_and_defaults_it_reads() -> None:
    global _FACTOR
    x = torch.randn(4)
    first = _keys(lambda t: _times_factor(t), x)
    _FACTOR = 3.0
    try:
        other_global = _keys(lambda t: _times_factor(t), x)
    finally:
        _FACTOR = 2.0
    _times_factor.__defaults__ = (5.0,)
    try:
        other_default = _keys(lambda t: _times_factor(t), x)
    finally:
        _times_factor.__defaults__ = (1.0,)
    assert len({*first, *other_global, *other_default}) == 3


def test_a_failure_is_remembered_per_tolerance_and_never_for_the_machines_errors(tmp_path: Path) -> None:
    from aotc.backend.given_up import GivenUpBefore, raise_if_given_up, remember
    from aotc.cache import Store, failures
    from aotc.errors import CompileError, NumericMismatchError

    store = Store(tmp_path / "s")
    key = "a" * 64
    remember(store, "m", None, [], key, NumericMismatchError("differs"), (1e-4, 1e-4))
    with pytest.raises(GivenUpBefore, match="differs"):
        raise_if_given_up(store, key, (1e-4, 1e-4))
    raise_if_given_up(store, key, (1e-2, 1e-2))  # another tolerance: tried again
    disk = CompileError("Inductor failed")
    disk.__cause__ = OSError(28, "No space left on device")
    remember(store, "m", None, [], "b" * 64, disk, None)
    oom = CompileError("Inductor failed: RuntimeError: CPU out of memory")
    remember(store, "m", None, [], "c" * 64, oom, None)
    assert [f.key for f in failures.failures(store)] == [key]
