"""Compile time against a model's depth: a repeated layer traced once (issue 46), side by side.

    python -m bench.depth [--runs N] [--out DIR]          (make bench-depth, about 10 min here)

Every figure is a fresh process, median of ``--runs`` (3): each with an empty store and an empty
Inductor cache dir, one ``$TMPDIR`` for all (the machine's precompiled C++ headers — Inductor's,
and aotc's for the backend's kernel batch — built once before the first: a cold machine's header
is not what depth changes).

- ``manifest``: ``aotc compile --json`` of the toy Llama at 2 and 32 layers (one compile size),
  ``regions: off`` (every layer traced, as before) and ``auto`` (each kind of layer traced once):
  the process's wall time and aotc's own (its phases, the model's build left out), Dynamo's
  capture and its share.
- ``backend``: ``torch.compile(model, backend=aotc)`` of the same toy model, the first call of a
  fresh process, at 2 and 32 layers; plain, and with the layer marked by the user as a nested
  compile region (``torch.compiler.nested_compile_region``: the backend is called after Dynamo's
  trace, so how the model is traced is the caller's). The backend's own seconds beside.
- ``real``: ``aotc compile`` of a Qwen2-0.5B-shaped model (random weights) at 2 and 24 layers,
  regions off and auto.

Writes ``results/depth.json`` and ``depth.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.real import QWEN2_05B  # noqa: E402
from bench.report import fmt, write_results  # noqa: E402

BACKEND_CHILD = """
import json, sys, time
t0 = time.time()
import torch, aotc
from aotc.models import toy_llama as tl
layers, marked, store = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
if marked:
    tl.Layer.forward = torch.compiler.nested_compile_region(tl.Layer.forward)
model = tl.build(layers=layers, hidden=256, heads=4, vocab=1024)
ids, pos = torch.randint(0, 1024, (16,)), torch.arange(16)
torch._dynamo.mark_dynamic(ids, 0)
torch._dynamo.mark_dynamic(pos, 0)
be = aotc.backend(store=store, fallback="error")
t = time.perf_counter()
with torch.no_grad():
    out = torch.compile(model, backend=be)(ids, pos)
first = time.perf_counter() - t
with torch.no_grad():
    err = (out - model(ids, pos)).abs().max().item()
print(json.dumps({"first_call": first, "backend": be.last["seconds"], "pieces": be.last["pieces"],
                  "err": err, "started": t0}))
"""


def toy_manifest(work: Path, layers: int, regions: str) -> Path:
    import yaml

    data = yaml.safe_load((ROOT / "manifests" / "toy-llama.yaml").read_text())
    data.update(name=f"depth-toy-{layers}L-{regions}", compile_sizes=[16], store=None, regions=regions)
    data["model"]["kwargs"].update(layers=layers)
    path = work / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def real_manifest(work: Path, layers: int, regions: str) -> Path:
    # use_cache false: a forward that builds no KV cache (whose update in each layer would make
    # no layer reusable: repeated.py); the model as a forward-only server would configure it
    cfg = ", ".join(f"{k}: {json.dumps(v)}" for k, v in
                    dict(QWEN2_05B, num_hidden_layers=layers, use_cache=False).items())
    path = work / f"depth-real-{layers}L-{regions}.yaml"
    path.write_text(f"""name: depth-real-{layers}L-{regions}
model:
  hf: {{architecture: Qwen2ForCausalLM, config: {{{cfg}}}}}
  weights: random
  output: logits
inputs:
  - {{name: input_ids, dtype: int64, shape: [1, tokens], high: 1000}}
  - {{name: position_ids, dtype: int64, shape: [1, tokens], fill: arange}}
compile_sizes: [16]
splitting_ops: ["aten::scaled_dot_product_attention"]
regions: {regions}
""")
    return path


def _env(work: Path) -> dict[str, str]:
    ind = work / "inductor"
    shutil.rmtree(ind, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AOTC_")}
    return dict(env, TORCHINDUCTOR_CACHE_DIR=str(ind), TMPDIR=str(work / "tmp"))


def compile_once(work: Path, manifest: Path) -> dict[str, Any]:
    """``aotc compile --json`` in a fresh process on an empty store."""
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    t = time.time()
    done = subprocess.run([sys.executable, "-m", "aotc.cli", "--store", str(store), "compile", "--json",
                           "-q", str(manifest)], capture_output=True, text=True, env=_env(work), cwd=ROOT)
    wall = time.time() - t
    if done.returncode != 0:
        raise SystemExit(f"aotc compile {manifest.name} failed:\n{done.stderr[-3000:]}")
    res = json.loads(done.stdout)
    secs = res["seconds"]
    own = sum(v for k, v in secs.items() if k != "build")
    return {"wall": wall, "aotc": own, "capture": secs.get("capture", 0.0), "split": secs.get("split", 0.0),
            "build": secs.get("build", 0.0)}


def backend_once(work: Path, layers: int, marked: bool) -> dict[str, Any]:
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    t = time.time()
    done = subprocess.run([sys.executable, "-c", BACKEND_CHILD, str(layers), "1" if marked else "0",
                           str(store)], capture_output=True, text=True, env=_env(work), cwd=ROOT)
    wall = time.time() - t
    if done.returncode != 0:
        raise SystemExit(f"backend child failed:\n{done.stderr[-3000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if res["err"] > 1e-4:
        raise SystemExit(f"backend at {layers} layers differs from eager by {res['err']}")
    return {"wall": wall, "first_call": res["first_call"], "backend": res["backend"]}


def median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


_WARM_KERNEL_HEADER = """
from aotc._torch import isa_probes, kernel_header
from aotc.backend.config import DEFAULT_INDUCTOR
from aotc.lookup.toolchain import fingerprint
kernel_header.keep_headers(fingerprint("cpu"))
job = kernel_header.start(kernel_header.kernel_command_template(isa_probes.predicted_isa(), dict(DEFAULT_INDUCTOR)))
if job is not None:
    job.done.wait(600)
"""


def say(msg: str) -> None:
    print(f"[depth] {msg}", file=sys.stderr, flush=True)


def bench(work: Path, runs: int) -> dict[str, Any]:
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    say("warming the machine (the C++ headers, once)")
    compile_once(work, toy_manifest(work, 2, "off"))
    # the backend's batch header too (aotc._torch.kernel_header): otherwise whether a run finds it
    # depends on whether an earlier run's trace was long enough to finish it
    subprocess.run([sys.executable, "-c", _WARM_KERNEL_HEADER], check=True, env=_env(work), cwd=ROOT)
    out: dict[str, Any] = {"manifest": {}, "backend": {}, "real": {}}
    for layers in (2, 32):
        for regions in ("off", "auto"):
            say(f"manifest toy {layers}L regions {regions}")
            m = toy_manifest(work, layers, regions)
            out["manifest"][f"{layers}L-{regions}"] = median([compile_once(work, m) for _ in range(runs)])
    for layers in (2, 32):
        for marked in (False, True):
            say(f"backend toy {layers}L {'marked' if marked else 'plain'}")
            out["backend"][f"{layers}L-{'marked' if marked else 'plain'}"] = median(
                [backend_once(work, layers, marked) for _ in range(runs)])
    for layers in (2, 24):
        for regions in ("off", "auto"):
            say(f"manifest Qwen2-0.5B-shaped {layers}L regions {regions}")
            m = real_manifest(work, layers, regions)
            out["real"][f"{layers}L-{regions}"] = median([compile_once(work, m) for _ in range(runs)])
    return out


def ratios(r: dict[str, Any]) -> dict[str, float]:
    m, b, q = r["manifest"], r["backend"], r["real"]
    out = {}
    for mode in ("off", "auto"):
        out[f"manifest wall 32L/2L regions {mode}"] = m[f"32L-{mode}"]["wall"] / m[f"2L-{mode}"]["wall"]
        out[f"manifest aotc 32L/2L regions {mode}"] = m[f"32L-{mode}"]["aotc"] / m[f"2L-{mode}"]["aotc"]
        out[f"real wall 24L/2L regions {mode}"] = q[f"24L-{mode}"]["wall"] / q[f"2L-{mode}"]["wall"]
        out[f"real aotc 24L/2L regions {mode}"] = q[f"24L-{mode}"]["aotc"] / q[f"2L-{mode}"]["aotc"]
    for mode in ("plain", "marked"):
        out[f"backend first call 32L/2L {mode}"] = b[f"32L-{mode}"]["first_call"] / b[f"2L-{mode}"]["first_call"]
        out[f"backend own 32L/2L {mode}"] = b[f"32L-{mode}"]["backend"] / b[f"2L-{mode}"]["backend"]
    for name, group, deep in (("toy", m, "32L"), ("real", q, "24L")):
        for mode in ("off", "auto"):
            out[f"{name} {deep} capture share regions {mode}"] = group[f"{deep}-{mode}"]["capture"] / group[f"{deep}-{mode}"]["aotc"]
    return out


def markdown(results: dict[str, Any]) -> str:
    r = results["results"]
    lines = [f"# Compile time against depth ({results['when']}, {results['runs']} runs each, medians)", "",
             "| door | model | layers | mode | wall s | aotc's own s | capture s | split s |", "|---|---|---|---|---|---|---|---|"]
    for door, model, group in (("manifest", "toy", "manifest"), ("manifest", "Qwen2-0.5B-shaped", "real")):
        for name, row in r[group].items():
            lay, mode = name.split("-")
            lines.append(f"| {door} | {model} | {lay} | regions {mode} | {fmt(row['wall'])} | {fmt(row['aotc'])} | "
                         f"{fmt(row['capture'])} | {fmt(row['split'])} |")
    lines += ["", "| door | layers | mode | wall s | first call s | backend's own s |", "|---|---|---|---|---|---|"]
    for name, row in r["backend"].items():
        lay, mode = name.split("-")
        lines.append(f"| backend | {lay} | {mode} | {fmt(row['wall'])} | {fmt(row['first_call'])} | {fmt(row['backend'])} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in results["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    t = time.time()
    with tempfile.TemporaryDirectory(prefix="aotc-depth-") as tmp:
        r = bench(Path(tmp), args.runs)
    results = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": args.runs,
               "minutes": round((time.time() - t) / 60, 1), "results": r, "ratios": ratios(r)}
    write_results(args.out, "depth", results, markdown(results))
    return results


if __name__ == "__main__":
    main()
