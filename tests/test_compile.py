"""``aotc compile`` end to end: real Dynamo captures, real Inductor compiles (tiny models), one
session-scoped store shared by every test so each model is compiled once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from aotc.cache import Store, scan
from aotc.cli import cli
from tests.conftest import AOTC_CLI, ROOT, SIZES, python_env, toy_manifest

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("layers", [2, 4])
def test_pieces_and_unique_compiles(compiled, layers: int) -> None:
    _tmp, _store, results = compiled
    _m, res, before, after = results[layers]
    assert not res.hit
    assert res.pieces == 2 * layers + 1
    assert res.unique_pieces == 3
    if layers == 2:  # compiled first, into an empty store
        assert res.compiles == 3 * (1 + len(SIZES)) and res.shared == 0  # whatever the depth
        entry = _store.get(res.key, record=False)
        libs = {r for r in entry.blobs if r.startswith("kernel/") and r.endswith(".main.so")}
        # the pieces have kernels in common (aotc._torch.kernel_pool): each one is built once
        assert res.kernels["pooled"] > 0 and res.kernels["built"] == len(libs)
    else:  # every (piece, size) is its 2-layer sibling's: taken from that entry (aotc.compile.reuse)
        assert res.compiles == 0 and res.shared == 3 * (1 + len(SIZES)) and res.kernels["built"] == 0
    assert after["compiles"] - before["compiles"] == res.compiles  # Inductor really ran that often
    assert after["traces"] - before["traces"] == 1
    assert res.max_abs_err is not None and res.max_abs_err <= 1e-4
    checked = set(res.numerics["sizes"])
    assert "4" in checked and len(checked) >= 3  # compile sizes, between, above


def test_hf_llama_splits_at_sdpa_and_matches_eager(compiled) -> None:
    _tmp, _store, results = compiled
    _m, res, _b, _a = results["hf"]
    assert res.pieces == 2 * 2 + 1
    assert res.max_abs_err <= 1e-4
    assert res.unique_pieces >= 2


def test_entry_contents(compiled) -> None:
    _tmp, store, results = compiled
    from aotc.records.program import PROGRAM_ROLE, Program

    res = results[2][1]
    entry = store.get(res.key, record=False)
    program = Program.from_json(store.read_blob(entry, PROGRAM_ROLE))
    assert [p.kind for p in program.pieces] == ["compiled", "splitting"] * 2 + ["compiled"]
    assert len(program.artifacts) == 3 * (1 + len(SIZES)) and program.kernel_roles
    assert "aotc/models/toy_llama.py" in program.source_files
    assert entry.factors["code"]["aotc/models/toy_llama.py"] == program.source_files["aotc/models/toy_llama.py"]
    assert set(entry.factors) == {"manifest", "toolchain", "inductor", "global", "aotc", "code"}
    text = json.dumps(entry.factors)
    assert str(ROOT) not in text and "/tmp" not in text  # no absolute paths in the key
    assert entry.metadata["pieces"] == 5 and entry.metadata["unique_pieces"] == 3


def test_second_compile_is_a_hit(compiled) -> None:
    from aotc.compile.pipeline import compile_manifest
    from aotc._torch.inductor_facts import counters_snapshot

    _tmp, store, results = compiled
    manifest, first, _b, _a = results[2]
    before = counters_snapshot()
    t = time.perf_counter()
    again = compile_manifest(manifest, store=store)
    elapsed = time.perf_counter() - t
    after = counters_snapshot()
    assert again.hit and again.key == first.key
    assert (again.traces, again.compiles) == (0, 0)
    assert after["traces"] == before["traces"]
    assert after["frames_traced"] == before["frames_traced"]
    assert after["compiles"] == before["compiles"]
    assert elapsed < 3.0
    assert len([e for e in scan(store).entries if e.key == first.key]) == 1


def test_cli_compile_hit_json_in_fresh_process(compiled) -> None:
    tmp, store, results = compiled
    manifest = results[4][0]
    t = time.perf_counter()
    out = subprocess.run([*AOTC_CLI, "--store", str(store.root), "compile",
                          str(manifest), "--json"], capture_output=True, text=True,
                         env=python_env(), timeout=120)
    elapsed = time.perf_counter() - t
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["hit"] and data["compiles"] == 0 and data["traces"] == 0
    assert data["key"] == results[4][1].key
    assert {"key", "pieces", "unique_pieces", "compiles", "seconds", "max_abs_err"} <= set(data)
    assert elapsed < 3.0 + 8.0  # 3 s of our own work plus importing torch on a loaded 2-core box


def test_changed_manifest_misses_and_explain_names_the_field(compiled, tmp_path) -> None:
    _tmp, store, _results = compiled
    m = toy_manifest(tmp_path, 2, compile_sizes=[1, 4, 8])
    res = CliRunner().invoke(cli, ["--store", str(store.root), "explain", str(m)],
                             catch_exceptions=False)
    assert res.exit_code == 0
    assert "miss" in res.output and "manifest.compile_sizes" in res.output


def test_explain_two_keys_diffs_their_factors(compiled) -> None:
    _tmp, store, results = compiled
    k2, k4 = results[2][1].key, results[4][1].key
    res = CliRunner().invoke(cli, ["--store", str(store.root), "explain", k2[:12], k4, "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert {"path": "manifest.model.kwargs.layers", "a": 2, "b": 4} in report["diff"]
    assert all(not d["path"].startswith("toolchain.") for d in report["diff"])  # same machine
    same = CliRunner().invoke(cli, ["--store", str(store.root), "explain", k2, k2])
    assert same.exit_code == 0 and "same factors" in same.output
    bad = CliRunner().invoke(cli, ["--store", str(store.root), "explain", "deadbeefdeadbeef", k2])
    assert bad.exit_code == 2 and "no stored entries match 'deadbeefdeadbeef'" in bad.output
    three = CliRunner().invoke(cli, ["--store", str(store.root), "explain", "a", "b", "c"])
    assert three.exit_code == 2 and "KEY_A KEY_B" in three.output


BAD_MODELS = [
    ("missing module", {"factory": "no_such_pkg.models:build"}, [], "model.factory"),
    ("missing function", {"factory": "aotc.models.toy_llama:nope"}, [], "model.factory"),
    ("factory raises", {"factory": "FIX/bad_models.py:raises"}, [], "weights server unreachable"),
    ("not a module", {"factory": "FIX/bad_models.py:not_a_module"}, [], "not a torch.nn.Module"),
    ("graph break", {"factory": "FIX/bad_models.py:graph_break"}, [], "bad_models.py:"),
    ("op never found", {"factory": "FIX/bad_models.py:no_attention"}, [], "splitting_ops"),
    ("inputs out of range", {"factory": "FIX/bad_models.py:small_vocab"}, [], "IndexError"),
]


@pytest.mark.parametrize("label,model,_unused,needle", BAD_MODELS, ids=[b[0] for b in BAD_MODELS])
def test_bad_models_fail_cleanly(compiled, tmp_path, label, model, _unused, needle) -> None:
    _tmp, store, _results = compiled
    fixtures = ROOT / "tests" / "fixtures"
    model = {k: v.replace("FIX", str(fixtures)) for k, v in model.items()}
    m = toy_manifest(tmp_path, 2, name="bad", model=model)
    before = (store.keys(), sorted(p.name for p in store.blobs_dir.rglob("*")))
    res = CliRunner().invoke(cli, ["--store", str(store.root), "compile", str(m), "-q"],
                             catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert needle in lines[0]
    assert (store.keys(), sorted(p.name for p in store.blobs_dir.rglob("*"))) == before


def test_a_worker_killed_mid_compile_leaves_its_pieces_to_the_parent(tmp_path) -> None:
    """-j 2: the forked worker is killed as soon as it exists; this process compiles what it
    took, says so, and no worker is left behind."""
    import io
    import threading

    import psutil

    from aotc.compile.pipeline import compile_manifest
    from aotc.progress import Progress

    me = psutil.Process()
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_fork() -> None:  # a forked worker runs this process's own command line
        while not killed and not stop.wait(0.02):
            for p in me.children():
                try:
                    if p.cmdline() == me.cmdline():
                        p.kill()
                        killed.append(p.pid)
                except psutil.NoSuchProcess:
                    continue

    m = toy_manifest(tmp_path, 2, name="toy-2-killed-worker", compile_sizes=[4])
    killer = threading.Thread(target=kill_the_fork, daemon=True)
    killer.start()
    said = io.StringIO()
    try:
        res = compile_manifest(m, store=Store(tmp_path / "store"), jobs=2, progress=Progress(said))
    finally:
        stop.set()
        killer.join(timeout=5)
    assert killed, "no forked worker was seen"
    assert (res.unique_pieces, res.compiles) == (3, 6) and res.max_abs_err <= 1e-4
    assert "note: compile worker 1 failed after" in said.getvalue()
    assert "killed by signal 9" in said.getvalue()
    assert [p for p in me.children() if p.cmdline() == me.cmdline()] == []


def test_bad_manifest_exit_2_store_untouched(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {factory: a.b:c}\ninputs: []\ncompile_sizes: [1, '8x']\n")
    res = CliRunner().invoke(cli, ["--store", str(tmp_path / "store"), "compile", str(bad)],
                             catch_exceptions=False)
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and "bad.yaml" in res.output
    assert not (tmp_path / "store").exists()


def test_parallel_workers_compile_the_same_program(compiled, tmp_path) -> None:
    """-j 2: a worker forked after the split (this process has used OpenMP's thread team, which a
    fork leaves broken: aotc._torch.forked) takes tasks from the queue; same program."""
    from aotc.compile.pipeline import compile_manifest
    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.records.program import PROGRAM_ROLE, Program

    import io

    from aotc.progress import Progress

    store = Store(tmp_path / "store")  # empty: the session store would share every piece
    m = toy_manifest(tmp_path, 3, name="toy-3-parallel", compile_sizes=[4])
    import faulthandler

    import torch

    x = torch.randn(512, 512)
    (x @ x).sin().sum()  # a parallel region here: the fork inherits the team, not its threads
    before = counters_snapshot()["compiles"]
    said = io.StringIO()
    faulthandler.dump_traceback_later(600, exit=True)  # a worker that hangs fails the run
    try:
        res = compile_manifest(m, store=store, jobs=2, progress=Progress(said))
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert "0/6 compiling in 2 processes" in said.getvalue()
    assert "(worker 1)" in said.getvalue() and "note:" not in said.getvalue()
    assert (res.pieces, res.unique_pieces, res.compiles) == (7, 3, 6)
    assert counters_snapshot()["compiles"] - before == 6
    assert res.max_abs_err <= 1e-4
    program = Program.from_json(store.read_blob(store.get(res.key, record=False), PROGRAM_ROLE))
    assert sorted(set(a.uid for a in program.artifacts)) == sorted(set(program.unique_pieces))
    assert sorted((a.uid, a.size or 0) for a in program.artifacts) == sorted(
        (u, s) for u in set(program.unique_pieces) for s in (0, 4))
