"""``aotc.precompile`` / ``aotc.precompiled`` at their edges: bad input named, a graph break
refused (never stored as a fallback), nothing stored means the first call precompiles, a changed
source file is a miss (not stale code), and the manifest form ``aotc precompile`` feeding a
server's ``aotc.precompiled(model, name=…)`` in a fresh process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, ROOT, python_env, run_cli


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Breaks(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("a graph break")  # noqa: T201 - the point of the module
        return x * 2


def test_bad_example_inputs_are_named(tmp_path: Path) -> None:
    import aotc
    from aotc.errors import PrecompileError

    with pytest.raises(PrecompileError, match=r"example_inputs\[1\]: expected a tuple"):
        aotc.precompile(_Mlp(), [(torch.randn(2, 8),), 3.0], store=tmp_path / "s")
    with pytest.raises(PrecompileError, match="at least one example input"):
        aotc.precompile(_Mlp(), [], store=tmp_path / "s")
    with pytest.raises(PrecompileError, match="give a function, a bound method or an nn.Module"):
        aotc.precompile(42, [(torch.randn(2, 8),)], store=tmp_path / "s")


@pytest.mark.slow
def test_a_graph_break_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    import aotc
    from aotc.cache import Store
    from aotc.errors import PrecompileError

    with pytest.raises(PrecompileError, match="example_inputs\\[0\\]"):
        aotc.precompile(_Breaks(), [(torch.randn(2, 8),)], store=tmp_path / "s")
    assert [r for r in Store(tmp_path / "s").entry_rows() if "precompiled" in r["metadata"]] == []


@pytest.mark.slow
def test_nothing_stored_the_first_call_precompiles_and_the_next_load_finds_it(tmp_path: Path) -> None:
    import aotc

    model, x = _Mlp(), torch.randn(3, 8)
    with torch.no_grad():
        first = aotc.precompiled(model, store=tmp_path / "s")
        assert first.functions == [] and first.key is None
        torch.testing.assert_close(first(x), model(x))
        assert first.key is not None and len(first.functions) == 1 and first.served == 1
        again = aotc.precompiled(model, store=tmp_path / "s", precompile_missing=False)
        assert again.key == first.key
        torch.testing.assert_close(again(x), model(x))
        assert again.served == 1 and again.traced == 0


_MODULE = '''import torch

FACTOR = 1.0


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * FACTOR
'''

_CHILD = '''import json, sys, torch, aotc
sys.path.insert(0, sys.argv[1])
import edited
m = edited.Model()
x = torch.ones(2, 4)
with torch.no_grad():
    p = aotc.precompiled(m, store=sys.argv[2], precompile_missing=sys.argv[3] == "build")
    y = p(x)
print(json.dumps({"key": p.key, "served": p.served, "traced": p.traced, "err": float((y - m(x)).abs().max())}))
'''


@pytest.mark.slow
def test_an_edited_source_file_is_a_miss_never_stale_code(tmp_path: Path) -> None:
    """A module's source changes between processes (a constant edited in the file): the stored
    entry no longer matches its recorded hash, the call is traced, the answer is the new one."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "edited.py").write_text(_MODULE)
    (tmp_path / "child.py").write_text(_CHILD)

    def child(mode: str) -> dict:
        res = subprocess.run([PYTHON, str(tmp_path / "child.py"), str(src), str(tmp_path / "s"), mode],
                             capture_output=True, text=True, env=python_env(), timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    built = child("build")
    assert built["key"] and built["served"] == 1
    (src / "edited.py").write_text(_MODULE.replace("FACTOR = 1.0", "FACTOR = 3.0"))
    after = child("load")
    assert after["key"] is None and after["served"] == 0 and after["traced"] == 1, after
    assert after["err"] < 1e-5


_SERVER = '''import json, sys, torch
from aotc.manifest import load_manifest
from aotc.model.build import build_model, make_named_inputs
from aotc.dynamo_artifacts.manifest import precompiled_for
from aotc._torch.inductor_facts import counters_snapshot
m = load_manifest(sys.argv[1])
model = build_model(m)
with torch.no_grad():
    p = precompiled_for(m, model, store=sys.argv[2], precompile_missing=False)
    errs = [float((p(**make_named_inputs(m, n)).logits - model(**make_named_inputs(m, n)).logits).abs().max())
            for n in (4, 16)]
c = counters_snapshot()
print(json.dumps({"key": p.key, "served": p.served, "traced": p.traced, "err": max(errs),
                  "frames": c["frames_traced"], "graphs": c["graphs_captured"]}))
'''


@pytest.mark.slow
def test_the_manifest_form_feeds_a_server_with_no_trace(tmp_path: Path) -> None:
    manifest = ROOT / "manifests" / "tiny-hf-llama.yaml"
    store = tmp_path / "s"
    res = run_cli("--store", str(store), "precompile", str(manifest), "--size", "4", "--size", "16", "--json",
                  check=True, timeout=600)
    done = json.loads(res.stdout)
    assert done["name"] == "tiny-hf-llama" and done["sizes"] == [4, 16] and len(done["graphs"]) == 2
    assert done["load"].startswith("aotc.precompiled(model, name='tiny-hf-llama', splitting_ops=")
    (tmp_path / "server.py").write_text(_SERVER)
    out = subprocess.run([PYTHON, str(tmp_path / "server.py"), str(manifest), str(store)],
                         capture_output=True, text=True, env=python_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["key"] == done["key"] and got["served"] == 2 and got["traced"] == 0, got
    assert got["frames"] == 0 and got["graphs"] == 0 and got["err"] < 1e-4, got


def test_the_cli_refuses_bad_input(tmp_path: Path) -> None:
    res = run_cli("--store", str(tmp_path / "s"), "precompile", str(ROOT / "manifests" / "tiny-hf-llama.yaml"),
                  "--size", "0")
    assert res.returncode == 2 and "--size" in res.stderr
    vllm = tmp_path / "v.yaml"
    vllm.write_text("name: v\nvllm:\n  model: facebook/opt-125m\n")
    res = run_cli("--store", str(tmp_path / "s"), "precompile", str(vllm))
    assert res.returncode == 1 and "vLLM saves Dynamo's output itself" in res.stderr, res.stderr


class _Act(torch.nn.Module):
    """A function held as instance state: Dynamo guards its identity (a guard it cannot save)."""

    def __init__(self, fn) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act = torch.nn.Linear(8, 8), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


@pytest.mark.slow
def test_a_function_held_by_the_model_is_checked_by_name(tmp_path: Path) -> None:
    """Stored with ``act=torch.relu``; loaded for a model holding ``torch.sigmoid``: the identity
    check fails, the call is traced, the answer is sigmoid's — never relu's stored code."""
    import aotc

    x = torch.randn(3, 8)
    with torch.no_grad():
        built = aotc.precompile(_Act(torch.relu), [(x,)], store=tmp_path / "s")
        checks = {src: name for src, name in built.functions[0]._aotc_identities}
        assert checks.get("L['self'].act", "").endswith(".relu"), checks
        same = aotc.precompiled(_Act(torch.relu), store=tmp_path / "s", precompile_missing=False)
        torch.testing.assert_close(same(x), torch.relu(_Act(torch.relu).lin(x)))
        assert same.served == 1 and same.traced == 0
        other = _Act(torch.sigmoid)
        loaded = aotc.precompiled(other, store=tmp_path / "s", precompile_missing=False)
        assert loaded.key == built.key  # found: the class and code are the same
        torch.testing.assert_close(loaded(x), other(x))
        assert loaded.served == 0 and loaded.traced == 1, (loaded.served, loaded.traced)
        assert "L['self'].act is torch._VariableFunctionsClass.sigmoid, not" in loaded.last_miss, loaded.last_miss


@pytest.mark.slow  # the traced path it falls back to compiles
def test_code_with_no_source_file_is_refused(tmp_path: Path) -> None:
    """A module shipped as .pyc only: its code cannot be keyed by a source hash, so it is not
    stored (it could change under the same key). Dynamo itself cannot record its source (torch
    2.13); aotc's own check stands behind it."""
    import compileall
    import sys

    import aotc
    from aotc.errors import PrecompileError

    pkg = tmp_path / "lib"
    pkg.mkdir()
    (pkg / "nosource_mod.py").write_text("import torch\n\ndef double(x):\n    return torch.sin(x) * 2\n")
    compileall.compile_dir(str(pkg), legacy=True, quiet=1)
    (pkg / "nosource_mod.py").unlink()
    sys.path.insert(0, str(pkg))
    try:
        import nosource_mod

        with pytest.raises(PrecompileError, match="could not get source code|nosource_mod has no source file"):
            aotc.precompile(nosource_mod.double, [(torch.randn(4),)], store=tmp_path / "s")
        from aotc.cache import Store

        assert [r for r in Store(tmp_path / "s").entry_rows() if '"precompiled"' in r["metadata"]] == []
    finally:
        sys.path.remove(str(pkg))
        sys.modules.pop("nosource_mod", None)


@pytest.mark.slow
def test_threads_share_one_first_call_build(tmp_path: Path) -> None:
    """Four threads call a precompiled target with nothing stored: one builds, the others wait
    and run the stored code; every answer right, nothing traced twice."""
    import threading

    import aotc

    model, x = _Mlp(), torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
        p = aotc.precompiled(model, store=tmp_path / "s")
        got: list[torch.Tensor] = []

        def call() -> None:
            with torch.no_grad():
                for _ in range(5):
                    got.append(p(x))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 20 and all(torch.allclose(g, want, atol=1e-5) for g in got)
    assert p.served == 20 and p.traced == 0 and p.key is not None


def test_a_trust_policy_without_a_trusted_signer_stores_nothing(tmp_path: Path, monkeypatch) -> None:
    import aotc
    from aotc.errors import PrecompileError
    from aotc.fleet.trust import generate_key

    monkeypatch.setenv("AOTC_TRUST_KEYS", generate_key(tmp_path / "ci.key"))
    monkeypatch.delenv("AOTC_SIGNING_KEY", raising=False)
    with pytest.raises(PrecompileError, match="AOTC_SIGNING_KEY"):
        aotc.precompile(_Mlp(), [(torch.randn(2, 8),)], store=tmp_path / "s")


def test_an_unusable_store_is_one_warning_and_the_traced_path(tmp_path: Path, caplog) -> None:
    """The store cannot even be opened (its path under a regular file): no exception reaches the
    server; the call runs traced, right."""
    import aotc
    from tests.conftest import aotc_warnings

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    model, x = _Mlp(), torch.randn(2, 8)
    with torch.no_grad():
        p = aotc.precompiled(model, store=blocker / "store", fallback="eager")
        torch.testing.assert_close(p(x), model(x))
    assert p.key is None and p.traced == 1
    assert any("the stored entry is not used" in w for w in aotc_warnings(caplog))


def test_the_load_pauses_the_garbage_collector_and_puts_it_back() -> None:
    """Dynamo's guards are rebuilt with the GC off (a full collection of the server's heap set
    off by the unpickled objects was half the load); it is back as it was after, raise or not."""
    import gc

    from aotc.gc_pause import gc_paused as _gc_paused

    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _gc_paused():
        raise RuntimeError("a load that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            pass
        assert not gc.isenabled()  # a server that runs with the GC off keeps it off
    finally:
        gc.enable()


_INT8 = """import json, sys, torch, aotc
from aotc._torch.inductor_facts import counters_snapshot
from tests.fixtures.more_client_models import int8_llama
store, mode = sys.argv[1:3]
model = int8_llama(layers=1)
ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
if mode == "build":
    aotc.precompile(model, example_inputs=[((), {"input_ids": ids})], store=store, name="int8")
    print(json.dumps({}))
else:
    p = aotc.precompiled(model, name="int8", store=store, precompile_missing=False)
    err = float((p(input_ids=ids).logits - model(input_ids=ids).logits).abs().max())
    c = counters_snapshot()
    print(json.dumps({"served": p.served, "traced": p.traced, "err": err, "frames": c["frames_traced"],
                      "loads": c["loads"], "fast_loads": c["fast_loads"]}))
"""


@pytest.mark.slow
def test_torchao_int8_weights_are_precompiled_and_served_with_no_trace(tmp_path: Path) -> None:
    # Dynamo's guard pickler could not save an Int8Tensor weight's guards (it has no empty_like,
    # and torchao's extra_repr on each Linear is a bound partial): precompile refused, and every
    # warm start traced the model (aotc._torch.precompile fills both gaps while it saves)
    pytest.importorskip("torchao")
    store = tmp_path / "s"
    for mode in ("build", "serve"):  # each its own process: quantize_ sets Inductor options process-wide
        out = subprocess.run([PYTHON, "-c", _INT8, str(store), mode], capture_output=True, text=True,
                             env=python_env(), timeout=600)
        assert out.returncode == 0, (mode, out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["served"] == 1 and got["traced"] == 0 and got["frames"] == 0 and got["err"] < 1e-4, got
    # precompiled with grad enabled (a training graph, the quantized weights as subclass inputs):
    # every piece loads through aotc's fast runtime, checked bit for bit against Inductor's
    assert got["fast_loads"] == got["loads"] > 0, got
