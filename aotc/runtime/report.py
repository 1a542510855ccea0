"""``aotc run``: warm-start a compiled manifest in this process and run it at some token counts,
reporting the load-time breakdown, the trace/compile counters and (optionally) the error against
eager per size."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aotc.errors import NumericMismatchError


def run_manifest(manifest_path: Any, sizes: Sequence[int], store: Any = None,
                 check_eager: bool = False, trust: Any = (),
                 remote: Any = None) -> dict[str, Any]:
    """Load, run each size once, and report as a JSON-able dict (see ``aotc run --help``)."""
    import torch

    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.lookup.stores import as_manifest
    from aotc.model.build import make_named_inputs
    from aotc.model.state import named_buffers
    from aotc.runtime.checking import compare_runs, flat_tensors
    from aotc.runtime.loader import load

    manifest = as_manifest(manifest_path)
    before = counters_snapshot()
    t = time.perf_counter()
    runner = load(manifest, store=store, trust=trust, remote=remote)
    load_seconds = time.perf_counter() - t
    graphs = runner.graphs  # None unless CUDA graphs were captured (a GraphedRunner)
    per_size: dict[str, dict[str, Any]] = {}
    worst = 0.0
    first_call: dict[str, Any] | None = None
    buffers = named_buffers(runner.model) if check_eager else {}
    for n in sizes:
        inputs = make_named_inputs(manifest, n, seed=2)
        t = time.perf_counter()
        out = flat_tensors(runner(**inputs))
        if out[0].is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        if first_call is None:  # one-time costs (torch's custom-op machinery): apart
            first_call = {"tokens": n, "seconds": seconds}
        entry: dict[str, Any] = {"seconds": seconds, "shape": list(out[0].shape),
                                 "graph_size": graphs.serves(n) if graphs else None}
        if check_eager:  # from the state the call above started from (a KV cache: again)
            c = compare_runs(runner, runner.eager, list(inputs.values()), buffers,
                             manifest.tolerance.atol, manifest.tolerance.rtol)
            entry["max_abs_err"] = c.max_abs_err
            entry["ok"] = c.ok
            worst = max(worst, c.max_abs_err)
        per_size[str(n)] = entry
    after = counters_snapshot()
    report = {
        "name": manifest.name, "key": runner.key, "load_seconds": load_seconds,
        "first_call": first_call,
        "phases": dict(runner.timings.phases), "pulled_bytes": runner.timings.pulled_bytes,
        "traces": after["traces"] - before["traces"] + after["frames_traced"] - before["frames_traced"],
        "compiles": after["inductor_compiles"] - before["inductor_compiles"]
        + after["compiles"] - before["compiles"],
        "sizes": per_size,
        "fast_loads": after["fast_loads"] - before["fast_loads"],
        "cudagraphs": None if graphs is None else graphs.report.to_json(),
    }
    if check_eager:
        report["max_abs_err"] = worst
        bad = [n for n, e in per_size.items() if not e["ok"]]
        if bad:
            report["failed_sizes"] = bad
    return report


def check_report(report: dict[str, Any]) -> None:
    """Raise when ``--check-eager`` found a size above tolerance."""
    if report.get("failed_sizes"):
        raise NumericMismatchError(
            f"{report['name']}: compiled output differs from eager above tolerance at "
            f"{', '.join(report['failed_sizes'])} tokens (max abs err {report['max_abs_err']:.3g})")
