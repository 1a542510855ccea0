"""A server's first day: the server's own HF model bound and called by name, bf16, a stateful
model decoding through the Runner, vLLM-style out-variant attention on the fast path, factory
files importing their siblings, read-only and missing stores, and the errors a user meets."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import aotc
from aotc.model.build import make_named_inputs
from aotc.cache import CacheMiss, StoreNotFoundError
from aotc.cli import cli
from aotc.errors import InputError, NumericMismatchError
from aotc.manifest import load_manifest
from tests.conftest import AOTC_CLI, HELPERS, POSITION_SHIFT, PYTHON, ROOT, copy_store, hf_manifest, python_env

pytestmark = pytest.mark.slow

FIXTURE = ROOT / "tests" / "fixtures" / "serving_models.py"


def _factory_manifest(tmp: Path, name: str, fn: str, **fields) -> Path:
    data = {"name": name, "model": {"factory": f"models/model.py:{fn}", "kwargs": {"layers": 1}},
            "max_tokens": 64, **fields}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """One store: a KV-cache-in-buffers model and an out-variant attention model, both built by a
    factory *file* that imports a sibling module (``models/model.py`` → ``models_impl``)."""
    tmp = tmp_path_factory.mktemp("serving")
    (tmp / "models").mkdir()
    shutil.copy(FIXTURE, tmp / "models" / "models_impl.py")
    (tmp / "models" / "model.py").write_text(
        "from models_impl import build_cache, build_out_variant  # a sibling module\n")
    # the forward is (positions, input_ids): the manifest's order differs, names decide
    cache = _factory_manifest(
        tmp, "cache-lm", "build_cache",
        inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 64},
                {"name": "positions", "dtype": "int64", "shape": ["tokens"], "fill": "arange"}],
        compile_sizes=[1], splitting_ops=["aten::scaled_dot_product_attention"])
    out = _factory_manifest(
        tmp, "out-lm", "build_out_variant",
        inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 64}],
        compile_sizes=[], splitting_ops=["aotc_test::attn_out"])
    out_data = yaml.safe_load(out.read_text())
    out_data["model"].update(kwargs={"layers": 2}, output=["logits", "hidden"])
    out.write_text(yaml.safe_dump(out_data))
    store = tmp / "store"
    results = {"cache": (cache, aotc.compile(cache, store=store)),
               "out": (out, aotc.compile(out, store=store))}
    return tmp, store, results


# ---------------------------------------------------------------- inputs by name, the server's model


def test_hf_model_from_pretrained_binds_and_is_called_by_name(compiled) -> None:
    from transformers import LlamaForCausalLM

    tmp, store, results = compiled
    manifest = load_manifest(results["hf"][0])
    server_model = LlamaForCausalLM.from_pretrained(str(tmp / "hf-model")).eval()  # as HF returns it
    runner = aotc.load(manifest, model=server_model, store=store)
    x = make_named_inputs(manifest, 6)
    assert int(x["position_ids"][0, 0]) == POSITION_SHIFT
    with torch.no_grad():
        assert torch.allclose(runner(**x), server_model(**x).logits, atol=1e-4, rtol=1e-4)
    # RoPE only sees relative positions, so spread them too: positions that reach the wrong
    # parameter (attention_mask) leave the model on 0..T-1, and the logits show it
    x["position_ids"] = POSITION_SHIFT + 2 * torch.arange(6)[None, :]
    with torch.no_grad():
        want = server_model(**x).logits
        wrong = server_model(x["input_ids"], x["position_ids"]).logits  # positions as attention_mask
    assert (wrong - want).abs().max() > 1e-3  # the test can tell a misrouted input
    assert torch.allclose(runner(**x), want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(runner(x["input_ids"], x["position_ids"]), want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(runner(x["input_ids"], position_ids=x["position_ids"]), want, atol=1e-4)
    with pytest.raises(InputError, match=r"unknown input 'positions'; the program takes input_ids, position_ids"):
        runner(input_ids=x["input_ids"], positions=x["position_ids"])
    with pytest.raises(InputError, match="missing input 'position_ids'"):
        runner(input_ids=x["input_ids"])
    with pytest.raises(InputError, match="given twice"):
        runner(x["input_ids"], input_ids=x["input_ids"])


def test_bf16_hf_model_default_tolerance_and_a_failed_check_reused_honestly(compiled, tmp_path) -> None:
    from transformers import LlamaForCausalLM

    tmp, _store, _results = compiled
    store = tmp_path / "store"
    strict = hf_manifest(tmp, dtype="bfloat16", name="hf-bf16", compile_sizes=[],
                         tolerance={"atol": 1e-4, "rtol": 1e-4})
    with pytest.raises(NumericMismatchError, match=r"atol=0.0001.*\(bfloat16\)"):
        aotc.compile(strict, store=store)
    loose = hf_manifest(tmp, dtype="bfloat16", name="hf-bf16", compile_sizes=[])  # dtype default
    res = CliRunner().invoke(cli, ["--store", str(store), "compile", "--json", str(loose)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["compiles"] == 0 and out["resumed"] == 3  # the pieces of the failed attempt
    from aotc._torch import regions

    if regions.supported():  # --json says what the capture did: a model with a KV cache, traced plainly
        assert re.fullmatch(r"traced every layer \(the model builds a KV cache .*\)", out["regions"]), out["regions"]
    assert out["resumed_from"] == "an earlier compile of this key that failed its numeric check"
    atol = load_manifest(loose).tolerance.atol
    assert 1e-3 < out["max_abs_err"] <= atol, out["numerics"]
    print(f"\nbf16 tiny HF Llama: max abs err vs eager {out['max_abs_err']:.3g} (default atol {atol})")

    server_model = LlamaForCausalLM.from_pretrained(str(tmp / "hf-model"), dtype=torch.bfloat16).eval()
    assert server_model.model.rotary_emb.inv_freq.dtype == torch.float32  # HF keeps it float32
    runner = aotc.load(loose, model=server_model, store=store)
    x = make_named_inputs(load_manifest(loose), 9)
    with torch.no_grad():
        want = server_model(**x).logits
    got = runner(**x)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), atol=atol, rtol=atol)


# ---------------------------------------------------------------- stateful models


def _greedy(call, prompt: torch.Tensor, steps: int) -> list[int]:
    logits = call(input_ids=prompt, positions=torch.arange(len(prompt)))
    tokens = [int(logits[-1].argmax())]
    for p in range(len(prompt), len(prompt) + steps - 1):  # decode: one token at a time
        logits = call(input_ids=torch.tensor([tokens[-1]]), positions=torch.tensor([p]))
        tokens.append(int(logits[-1].argmax()))
    return tokens


def test_kv_cache_in_buffers_checked_from_one_snapshot_and_decodes_like_eager(serving) -> None:
    _tmp, store, results = serving
    manifest, res = results["cache"]
    assert res.numerics["mutated_buffers"] == ["layers.0.k_cache", "layers.0.v_cache"]
    assert res.max_abs_err <= 1e-4
    runner = aotc.load(manifest, store=store)
    caches = [b for b in runner.model.buffers() if b.dtype.is_floating_point]
    gen = torch.Generator().manual_seed(7)
    for length in (3, 5, 9, 17):  # prompts of different lengths: prefill, then 15 decode steps
        prompt = torch.randint(0, 64, (length,), generator=gen)
        for c in caches:
            c.zero_()
        compiled_tokens = _greedy(runner, prompt, 16)
        compiled_state = [c.clone() for c in caches]
        for c in caches:
            c.zero_()
        eager_tokens = _greedy(runner.eager, prompt, 16)
        assert compiled_tokens == eager_tokens
        assert caches and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(compiled_state, caches))


def test_warmup_restores_state_and_run_reports_the_first_call(serving) -> None:
    _tmp, store, results = serving
    manifest, _res = results["cache"]
    runner = aotc.load(manifest, store=store)
    caches = [b for b in runner.model.buffers() if b.dtype.is_floating_point]
    for c in caches:
        c.normal_()
    before = [c.clone() for c in caches]
    seconds = runner.warmup()
    assert seconds > 0 and "warmup" in runner.timings.phases
    assert caches and all(torch.equal(a, b) for a, b in zip(before, caches))
    res = CliRunner().invoke(cli, ["--store", str(store), "run", str(manifest), "--sizes", "5,1",
                                   "--check-eager", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["first_call"]["tokens"] == 5 and report["first_call"]["seconds"] > 0
    assert all(e["ok"] for e in report["sizes"].values())
    text = CliRunner().invoke(cli, ["--store", str(store), "run", str(manifest), "--sizes", "5,1"],
                              catch_exceptions=False).output
    assert "first call (5 tokens)" in text


# ---------------------------------------------------------------- out-variant attention, outputs


def test_out_variant_attention_keeps_the_fast_path_in_a_fresh_process(serving) -> None:
    _tmp, store, results = serving
    manifest, res = results["out"]
    assert res.warnings == ()  # no piece fell back to Inductor's loader
    out = subprocess.run([PYTHON, str(HELPERS / "warm_start.py"), str(manifest), str(store), "2", "7"],
                         capture_output=True, text=True, env=python_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["counters"]["fast_loads"] == report["counters"]["loads"] == 3
    assert report["inductor_modules"] == []
    assert all(e <= 1e-4 for e in report["errs"].values())
    print(f"\nout-variant attention model, fresh process: aotc.load {report['load_s']:.3f}s "
          f"(phases {report['phases']})")
    from aotc.counters import COUNTERS

    with COUNTERS.expect(loads=3, fast_loads=3, cache_hits=1):  # no trace, no compile
        runner = aotc.load(manifest, store=store)
    logits, hidden = runner(input_ids=torch.arange(6))  # output: [logits, hidden]
    want = runner.eager(input_ids=torch.arange(6))
    assert logits.shape == (6, 64) and hidden.shape == (6, 32)
    assert torch.allclose(logits, want[0], atol=1e-4) and torch.allclose(hidden, want[1], atol=1e-4)


# ---------------------------------------------------------------- errors at the boundary


def test_strided_inputs_are_accepted_and_kernel_errors_name_the_input(serving) -> None:
    _tmp, store, results = serving
    manifest, _res = results["cache"]
    runner = aotc.load(manifest, store=store)
    ids, pos = torch.randint(0, 64, (12,)), torch.arange(12)
    got = runner(ids[::2], pos[::2])  # non-contiguous views
    want = runner.eager(input_ids=ids[::2].contiguous(), positions=pos[::2].contiguous())
    assert torch.allclose(got, want, atol=1e-4)
    with pytest.raises(InputError) as info:
        runner(input_ids=torch.tensor([3, 70]), positions=torch.arange(2))
    msg = str(info.value)
    assert "input 'input_ids' holds 70, outside [0, 64)" in msg and "piece submod_0" in msg
    assert "index out of bounds" in msg and "/tmp" not in msg and ".cpp" not in msg


def test_missing_store_is_named_and_never_created(tmp_path, serving) -> None:
    _tmp, _store, results = serving
    manifest = results["cache"][0]
    nowhere = tmp_path / "typo-store"
    for args in (["run", str(manifest)], ["inspect", "cache"], ["verify"], ["gc"], ["explain", str(manifest)]):
        res = CliRunner().invoke(cli, ["--store", str(nowhere), *args], catch_exceptions=False)
        assert res.exit_code == 1, (args, res.output)
        assert res.output.count("\n") == 1 and f"no aotc store at {nowhere}" in res.output, res.output
    with pytest.raises(StoreNotFoundError, match="no aotc store"):
        aotc.load(manifest, store=nowhere)
    assert not nowhere.exists()


def test_a_miss_names_the_lookup_key_and_the_closest_entry(serving) -> None:
    _tmp, store, results = serving
    manifest, res = results["cache"]
    changed = load_manifest(manifest).replace(compile_sizes=[1, 2])
    with pytest.raises(CacheMiss) as info:
        aotc.load(changed, store=store)
    msg = str(info.value)
    assert "no store entry for lookup key" in msg
    assert f"the closest stored entry, key {res.key[:16]}… (cache-lm), differs in manifest.compile_sizes" in msg


def test_gc_dry_run_says_what_min_idle_protects(serving) -> None:
    _tmp, store, _results = serving
    res = CliRunner().invoke(cli, ["--store", str(store), "gc", "--max-size", "0", "--dry-run"],
                             catch_exceptions=False)
    assert res.exit_code == 0
    assert "would free" in res.output and "0 entries" in res.output
    assert "kept 2 entries over --max-size that were written or read in the last 300s (--min-idle" in res.output


def test_changed_file_is_seen_even_with_size_and_mtime_kept(tmp_path) -> None:
    from aotc.lookup.filehash import file_sha256

    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    first = file_sha256(f)
    st = os.stat(f)
    f.write_text("x = 2\n")  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    assert file_sha256(f) != first


def test_hf_lookup_imports_no_model_code(compiled) -> None:
    """The lookup hashes the transformers files the trace recorded without importing them."""
    _tmp, store, results = compiled
    code = ("import sys, aotc.lookup.resolve as r, aotc.lookup.toolchain as t, aotc.manifest as mf\n"
            "from aotc.cache import Store\n"
            f"m = mf.load_manifest({str(results['hf'][0])!r}); s = Store({str(store.root)!r})\n"
            "res = r.resolve(m, s, t.machine_factors(m.device, s.base / 'toolchain'), record=False)\n"
            "print(res.hit, 'transformers' in sys.modules)\n")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=python_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


# ---------------------------------------------------------------- read-only stores


def _read_only_mount_works() -> str:
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs Linux, root and unshare(1) for a private read-only bind mount"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --make-rprivate / && "
                            "mount --bind /tmp /mnt && mount -o remount,bind,ro /mnt"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"read-only bind mounts unavailable: {probe.stderr.strip()}"


def test_serving_from_a_read_only_store(serving, tmp_path) -> None:
    why = _read_only_mount_works()
    if why:
        pytest.skip(why)
    _tmp, store, results = serving
    manifest = results["cache"][0]
    ro_src, mnt = tmp_path / "image-layer", tmp_path / "mnt"
    copy_store(store, ro_src)
    mnt.mkdir()
    index = ro_src / "store-v1" / "index.sqlite"
    before = (index.stat().st_mtime_ns, sorted(p.name for p in index.parent.iterdir()))
    aotc_cmd = " ".join([*AOTC_CLI, "--store", str(mnt)])
    script = " && ".join([
        "mount --make-rprivate /", f"mount --bind {ro_src} {mnt}", f"mount -o remount,bind,ro {mnt}",
        f"! touch {mnt}/probe 2>/dev/null",  # really read-only
        f"{aotc_cmd} run {manifest} --sizes 1,4 --check-eager --json > {tmp_path}/run.json",
        f"{aotc_cmd} inspect cache --json > {tmp_path}/inspect.json",
        f"{aotc_cmd} verify --json > {tmp_path}/verify.json",
        f"{PYTHON} -c \"import aotc; r = aotc.load({str(manifest)!r}, store={str(mnt)!r}); "
        f"print(r.key)\" > {tmp_path}/load.txt",
    ])
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         env=python_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((tmp_path / "run.json").read_text())
    assert all(e["ok"] for e in run["sizes"].values()) and run["compiles"] == 0
    assert len(json.loads((tmp_path / "inspect.json").read_text())["entries"]) == 2
    assert json.loads((tmp_path / "verify.json").read_text())["ok"] is True
    assert (tmp_path / "load.txt").read_text().strip() == results["cache"][1].key
    notes = [ln for ln in out.stderr.splitlines() if "is read-only" in ln]
    assert len(notes) == 4 and "hits and last-use times are not recorded" in notes[0]  # once per process
    assert (index.stat().st_mtime_ns, sorted(p.name for p in index.parent.iterdir())) == before
    print(f"\nread-only store: aotc run warm start {run['load_seconds']:.3f}s, "
          f"first call {run['first_call']['seconds']:.3f}s")
    res = subprocess.run(["unshare", "-m", "sh", "-c", " && ".join([
        "mount --make-rprivate /", f"mount --bind {ro_src} {mnt}", f"mount -o remount,bind,ro {mnt}",
        f"{aotc_cmd} verify --repair; echo rc=$?",
        f"{aotc_cmd} compile -q {manifest} > {tmp_path}/hit.txt; echo rc=$?",
        f"{aotc_cmd} compile --force {manifest}; echo rc=$?"])],
        capture_output=True, text=True, env=python_env(), timeout=120)
    assert res.stdout.split() == ["rc=1", "rc=0", "rc=1"], res.stdout + res.stderr[-2000:]
    assert "up to date" in (tmp_path / "hit.txt").read_text()  # a lookup needs no write
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert errors == [f"Error: store {mnt} is read-only: cannot repair it; use a writable store "
                      "(--store DIR / AOTC_STORE) for that",
                      f"Error: store {mnt} is read-only: cannot compile into it; use a writable "
                      "store (--store DIR / AOTC_STORE) for that"], res.stderr[-2000:]
