"""``aotc run``: warm-start a compiled manifest in this process and run it at some token counts,
reporting the load-time breakdown, the trace/compile counters and (optionally) the error against
eager per size."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from aotc.errors import NumericMismatchError


def run_manifest(manifest_path: str | Path, sizes: Sequence[int], store: Any = None,
                 check_eager: bool = False, trust: Sequence[str] = (),
                 remote: Any = None) -> dict[str, Any]:
    """Load, run each size once, and report as a JSON-able dict (see ``aotc run --help``)."""
    import torch

    from aotc.build import make_inputs
    from aotc.stores import as_manifest
    from aotc.inductor import counters_snapshot
    from aotc.loader import load

    manifest = as_manifest(manifest_path)
    before = counters_snapshot()
    t = time.perf_counter()
    runner = load(manifest, store=store, trust=trust, remote=remote)
    load_seconds = time.perf_counter() - t
    per_size: dict[str, dict[str, Any]] = {}
    worst = 0.0
    for n in sizes:
        inputs = make_inputs(manifest, n, seed=2)
        t = time.perf_counter()
        out = runner(*inputs)
        if out.is_cuda:
            torch.cuda.synchronize()
        entry: dict[str, Any] = {"seconds": time.perf_counter() - t, "shape": list(out.shape),
                                 "graph_size": runner.graphs.serves(n) if runner.graphs else None}
        if check_eager:
            with torch.no_grad():
                want = runner.model(*inputs)
            err = float((out.float() - want.float()).abs().max())
            entry["max_abs_err"] = err
            entry["ok"] = bool(torch.allclose(out.float(), want.float(), atol=manifest.tolerance.atol,
                                              rtol=manifest.tolerance.rtol))
            worst = max(worst, err)
        per_size[str(n)] = entry
    after = counters_snapshot()
    report = {
        "name": manifest.name, "key": runner.key, "load_seconds": load_seconds,
        "phases": dict(runner.timings.phases), "pulled_bytes": runner.timings.pulled_bytes,
        "traces": after["traces"] - before["traces"] + after["frames_traced"] - before["frames_traced"],
        "compiles": after["inductor_compiles"] - before["inductor_compiles"]
        + after["compiles"] - before["compiles"],
        "sizes": per_size,
        "fast_loads": after["fast_loads"] - before["fast_loads"],
        "cudagraphs": None if runner.graphs is None else runner.graphs.report.to_json(),
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
