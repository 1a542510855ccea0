"""The warm start: a fresh process loads a compiled program with no trace and no compile, binds
the weights it is given, checks its inputs, and misses when a traced source file changed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import aotc
from aotc.model.build import build_model, make_inputs
from aotc.cache import CacheMiss
from aotc.errors import InputError, LoadError
from aotc.manifest import load_manifest
from tests.conftest import HELPERS, PYTHON, python_env, tiny_manifest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("loader", ["fast", "inductor"])
def test_fresh_process_warm_start_runs_nothing(compiled, loader) -> None:
    """Both load paths: the fast path (aotc._torch.wrapper, the default: Inductor is never imported)
    and CompiledArtifact.load (AOTC_LOADER=inductor, what a piece that does not qualify gets)."""
    _tmp, store, results = compiled
    manifest = results[2][0]
    sizes = [1, 3, 4, 9, 200]  # below, between, at and above the compile size; 1 is dynamic
    env = python_env()
    if loader == "inductor":
        env["AOTC_LOADER"] = "inductor"
    out = subprocess.run([PYTHON, str(HELPERS / "warm_start.py"), str(manifest), str(store.root),
                          *map(str, sizes)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(err <= 1e-4 for err in report["errs"].values()), report["errs"]
    c = report["counters"]
    assert c["traces"] == 0 and c["frames_traced"] == 0 and c["graphs_captured"] == 0
    assert c["compiles"] == 0 and c["inductor_compiles"] == 0
    assert c["loads"] == 3 * 2  # 3 unique pieces x (dynamic + size 4)
    if loader == "fast":
        assert c["fast_loads"] == 3 * 2
        assert report["inductor_modules"] == []  # not even imported
    else:
        assert c["fast_loads"] == 0 and report["inductor_modules"]
    compiler_runs = [cmd for cmd in report["commands"]
                     if any(part.endswith((".cpp", ".c")) for part in cmd) or "-shared" in cmd]
    assert compiler_runs == [], compiler_runs


def test_binds_the_given_modules_weights(compiled) -> None:
    _tmp, store, results = compiled
    manifest = load_manifest(results[2][0])
    other = build_model(manifest)  # the server's own weights: here, the same shapes, other values
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=gen))
    runner = aotc.load(manifest, model=other, store=store)
    x = make_inputs(manifest, 6)
    with torch.no_grad():
        got, want = runner(*x), other(*x)
        original = build_model(manifest)(*x)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, original, atol=1e-3)  # weights are not baked in


def test_bind_rejects_mismatched_module(compiled) -> None:
    _tmp, store, results = compiled
    manifest = load_manifest(results[2][0])
    wrong = build_model(manifest.replace(model={**manifest.to_dict()["model"],
                                                "kwargs": {"layers": 2, "hidden": 32, "heads": 4,
                                                           "vocab": 128}}))
    with pytest.raises(LoadError, match=r"has shape \[128, 32\].*compiled for \[128, 64\]"):
        aotc.load(manifest, model=wrong, store=store)


@pytest.mark.parametrize("make,match", [
    (lambda m: [x.to(torch.int32) for x in make_inputs(m, 4)], "dtype int64"),
    (lambda m: [x.unsqueeze(0) for x in make_inputs(m, 4)], "rank 1"),
    (lambda m: [x.to("meta") for x in make_inputs(m, 4)], "device cpu"),
    (lambda m: [x[:0] for x in make_inputs(m, 4)], r"token count 0 is outside \[1, max_tokens=256\]"),
    (lambda m: make_inputs(m, 257), r"token count 257 is outside"),
    (lambda m: make_inputs(m, 4)[:1], "expected 2 inputs"),
    (lambda m: [make_inputs(m, 4)[0], make_inputs(m, 5)[1]], "has 5 tokens, other inputs have 4"),
], ids=["dtype", "rank", "device", "zero", "too-many", "count", "mismatch"])
def test_runner_rejects_bad_inputs(compiled, make, match) -> None:
    _tmp, store, results = compiled
    manifest = load_manifest(results[2][0])
    runner = aotc.load(manifest, store=store)
    with pytest.raises(InputError, match=match):
        runner(*make(manifest))


def test_changed_source_file_is_a_miss_naming_it(compiled, tmp_path) -> None:
    _tmp, store, _results = compiled
    src = tmp_path / "mymodel.py"
    shutil.copy(Path(aotc.__file__).parent / "models" / "toy_llama.py", src)
    manifest = tiny_manifest(tmp_path, "edited", factory="mymodel.py:build")
    res = aotc.compile(manifest, store=store)
    assert res.compiles + res.shared == 2  # 1 layer: first and last piece, dynamic only
    aotc.load(manifest, store=store)  # a hit
    src.write_text(src.read_text() + "\n# an edit\n")
    with pytest.raises(CacheMiss) as info:
        aotc.load(manifest, store=store)
    msg = str(info.value)
    assert "changed source file: mymodel.py" in msg and "aotc compile" in msg


def test_cli_run_json_check_eager(compiled) -> None:
    from click.testing import CliRunner

    from aotc.cli import cli

    _tmp, store, results = compiled
    res = CliRunner().invoke(cli, ["--store", str(store.root), "run", str(results[2][0]),
                                   "--sizes", "1,4,9", "--check-eager", "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["key"] == results[2][1].key
    assert (data["traces"], data["compiles"]) == (0, 0)
    assert set(data["sizes"]) == {"1", "4", "9"}
    assert all(s["ok"] and s["max_abs_err"] <= 1e-4 for s in data["sizes"].values())
    assert {"resolve", "read+verify", "deserialize", "bind"} <= set(data["phases"])


def test_cli_run_miss_is_one_line_exit_1(compiled, tmp_path) -> None:
    from click.testing import CliRunner

    from aotc.cli import cli
    from tests.conftest import toy_manifest

    _tmp, store, _results = compiled
    m = toy_manifest(tmp_path, 2, compile_sizes=[2, 4])  # same name as a stored entry
    res = CliRunner().invoke(cli, ["--store", str(store.root), "run", str(m)], catch_exceptions=False)
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "aotc compile" in lines[0] and "aotc explain" in lines[0]
    assert "manifest.compile_sizes" in lines[0]
