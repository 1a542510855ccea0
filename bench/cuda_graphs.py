"""Steady-state latency on CUDA: eager vs aotc without graphs vs piecewise vs full CUDA graphs,
plus each mode's capture time, graph pool memory and largest error against eager. Needs a
compiled manifest; on a machine without CUDA (``scripts/gpu-check.sh --cpu``) the graph modes
are reported skipped and the rest is measured, so the script itself is tested anywhere.

    python bench/cuda_graphs.py MANIFEST STORE [--sizes 1,8,64] [--iters 50] [--out FILE]

Writes one JSON object (latencies in ms, medians over --iters calls after 3 warm-up calls) to
stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import aotc
from aotc.model.build import make_inputs
from aotc.errors import AotcError
from aotc.manifest import load_manifest


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def latency_ms(fn, inputs, iters: int) -> float:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        _sync()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn(*inputs)
            _sync()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def max_abs_err(runner, eager, inputs) -> float:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        got, want = runner(*inputs), eager(*inputs)
    return float((got.float() - want.float()).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("manifest")
    ap.add_argument("store")
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    manifest = load_manifest(args.manifest)
    cuda = manifest.device.startswith("cuda") and torch.cuda.is_available()
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "sizes": sizes, "modes": {}}
    model = eager = None
    for mode in ("none", "piecewise", "full"):
        if mode != "none" and not cuda:
            result["modes"][mode] = {"skipped": "no CUDA device"}
            continue
        m = manifest.replace(cudagraph=mode)
        t = time.perf_counter()
        try:
            runner = aotc.load(m, model=model, store=args.store)
        except AotcError as e:
            result["modes"][mode] = {"error": str(e)}
            continue
        model, eager = runner.model, runner.eager  # eager: the bound model, called by name
        entry = {"load_s": time.perf_counter() - t, "phases": runner.timings.phases,
                 "graphs": None if runner.graphs is None else runner.graphs.report.to_json(),
                 "ms": {}, "max_abs_err": {}}
        for n in sizes:
            inputs = make_inputs(m, n, seed=n)
            entry["max_abs_err"][str(n)] = max_abs_err(runner, eager, inputs)
            entry["ms"][str(n)] = latency_ms(runner, inputs, args.iters)
        result["modes"][mode] = entry
    if eager is not None:
        result["eager_ms"] = {str(n): latency_ms(eager, make_inputs(manifest, n, seed=n), args.iters)
                              for n in sizes}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
