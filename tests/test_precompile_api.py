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


_SERVER = '''import json, sys, torch, aotc
from aotc.manifest import load_manifest
from aotc.model.build import build_model, make_named_inputs
from aotc._torch.inductor_facts import counters_snapshot
m = load_manifest(sys.argv[1])
model = build_model(m)
with torch.no_grad():
    p = aotc.precompiled(model, name=m.name, store=sys.argv[2], precompile_missing=False)
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
    assert res.returncode == 2 and "vLLM saves Dynamo's output itself" in res.stderr, res.stderr
