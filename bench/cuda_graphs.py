"""Steady-state latency on CUDA: eager vs aotc without graphs vs piecewise vs full CUDA graphs,
plus each mode's capture time and graph pool memory. Needs a GPU and a compiled cuda manifest.

    python bench/cuda_graphs.py MANIFEST STORE [--sizes 1,8,64] [--iters 50]

Prints one JSON object (latencies in ms, medians over --iters calls after 3 warm-up calls).
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


def latency_ms(fn, inputs, iters: int) -> float:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn(*inputs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("manifest")
    ap.add_argument("store")
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    manifest = load_manifest(args.manifest)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "sizes": sizes, "modes": {}}
    model = None
    for mode in ("none", "piecewise", "full"):
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
                 "ms": {}}
        for n in sizes:
            entry["ms"][str(n)] = latency_ms(runner, make_inputs(m, n, seed=n), args.iters)
        result["modes"][mode] = entry
    if model is not None:
        result["eager_ms"] = {str(n): latency_ms(eager, make_inputs(manifest, n, seed=n), args.iters)
                              for n in sizes}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
