"""Time to first output in a fresh process, side by side: eager, torch.compile (cold and with a
hot Inductor cache), aotc (cold compile, then warm start). Each run is a new interpreter.

    python bench/warm_start.py [--manifest manifests/toy-llama.yaml] [--store DIR] [--json]

Printed per contender: import torch, model build, compile/load, first call, total; and the
startup overhead over eager (total - eager total) with its ratio to torch.compile's hot-cache one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, os, sys, time
t0 = time.perf_counter()
import torch
t_import = time.perf_counter() - t0
from aotc.manifest import load_manifest
from aotc.build import build_model, make_inputs
mode, manifest_path, store = sys.argv[1], sys.argv[2], sys.argv[3]
m = load_manifest(manifest_path)
t = time.perf_counter(); model = build_model(m); t_build = time.perf_counter() - t
x = make_inputs(m, 7)
t = time.perf_counter()
if mode == "eager":
    fn = model
elif mode == "torch.compile":
    fn = torch.compile(model, dynamic=True)
else:
    import aotc
    if mode == "aotc-cold":
        aotc.compile(m, store=store, force=True)
    fn = aotc.load(m, model=model, store=store)
t_prepare = time.perf_counter() - t
t = time.perf_counter()
with torch.no_grad():
    y = fn(*x)
t_first = time.perf_counter() - t
print(json.dumps({"import_torch": t_import, "build": t_build, "prepare": t_prepare,
                  "first_call": t_first, "total": time.perf_counter() - t0}))
'''


def run(mode: str, manifest: str, store: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, manifest, store], capture_output=True,
                         text=True, env=env, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default=str(ROOT / "manifests" / "toy-llama.yaml"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-bench-warm-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                   PYTHONPATH=str(ROOT))
        store = str(Path(tmp) / "store")
        rows = {
            "eager": run("eager", args.manifest, store, env),
            "torch.compile cold": run("torch.compile", args.manifest, store, env),
            "torch.compile hot": run("torch.compile", args.manifest, store, env),
            "aotc cold": run("aotc-cold", args.manifest, store, env),
            "aotc warm": run("aotc", args.manifest, store, env),
        }
    eager = rows["eager"]["total"]
    hot = rows["torch.compile hot"]["total"] - eager
    for r in rows.values():
        r["overhead_vs_eager"] = r["total"] - eager
        r["overhead_ratio_to_torch_compile_hot"] = r["overhead_vs_eager"] / hot if hot > 0 else None
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"time to first output, fresh process each ({Path(args.manifest).name}, 7 tokens)")
    print(f"{'':20s} {'import':>7} {'build':>6} {'prepare':>8} {'1st call':>8} {'total':>7} {'overhead':>8} {'vs tc-hot':>9}")
    for name, r in rows.items():
        ratio = r["overhead_ratio_to_torch_compile_hot"]
        print(f"{name:20s} {r['import_torch']:7.2f} {r['build']:6.2f} {r['prepare']:8.2f} "
              f"{r['first_call']:8.3f} {r['total']:7.2f} {r['overhead_vs_eager']:8.2f} "
              f"{'' if ratio is None else f'{ratio:9.2f}'}")


if __name__ == "__main__":
    main()
