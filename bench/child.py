"""One contender's start, in a fresh interpreter (run by bench/sidebyside.py; not for direct use).

    python bench/child.py CONFIG_JSON

CONFIG: {"mode", "manifest", "store", "first_tokens", "steady_sizes", "steady_iters",
"threads", "mega_save", "mega_load", "tc_dynamic"}; mode is one of eager, tc-cold, tc-warm, tc-mega,
aotc-cold, aotc-warm, aotc-remote (a load that pulls through cfg['remote']), or steady-pair: aotc warm and torch.compile warm in ONE process, timed in
alternating blocks (the order flips each round) so both see the same machine state — the
steady-state ratio's measurement (the cache directories are set by the parent through the
environment); ``tc_dynamic`` false compiles torch.compile's side with static shapes.
Prints one JSON line: wall-clock time of the first output (``first_output_at``, time.time(), for
the parent to subtract its spawn time), phase seconds, steady-state latencies, counters, peak RSS.
"""

from __future__ import annotations

import time

FIRST_LINE_AT = time.time()

import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402


def _counters() -> dict[str, int]:
    out = {"dynamo_frames": 0, "dynamo_graphs": 0, "inductor_compiles": 0}
    if "torch._dynamo.utils" in sys.modules:
        from torch._dynamo.utils import counters

        out["dynamo_frames"] = int(counters["frames"].get("total", 0))
        out["dynamo_graphs"] = int(counters["stats"].get("unique_graphs", 0))  # a precompile trace too
        ind = counters["inductor"]
        out["inductor_compiles"] = int(ind.get("fxgraph_cache_miss", 0) + ind.get("fxgraph_cache_bypass", 0))
    if "aotc.counters" in sys.modules:
        from aotc.counters import COUNTERS

        out["aotc_traces"], out["aotc_compiles"] = COUNTERS.traces, COUNTERS.compiles
        # standalone_compile counts in Inductor's own counter; aotc's Dynamo capture does not
        out["inductor_compiles"] = max(out["inductor_compiles"], COUNTERS.compiles)
        out["dynamo_frames"] += COUNTERS.traces
    return out


def _paired(a, b, xs, rounds: int, block: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median latency of ``a`` and ``b`` on ``xs`` and the median over rounds of the ratio of
    their block medians; each round runs a block of ``a`` and a block of ``b``, order flipped."""
    for f in (a, b, a, b):
        for _ in range(3):
            f(*xs)
    ta: list[float] = []
    tb: list[float] = []
    ratios = []
    for r in range(rounds):
        med = {}
        for name, f in (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a)):
            times = []
            for _ in range(block):
                t = time.perf_counter()
                f(*xs)
                times.append(time.perf_counter() - t)
            med[name] = statistics.median(times)
            (ta if name == "a" else tb).extend(times)
        ratios.append(med["a"] / med["b"])
    return {"aotc_ms": statistics.median(ta) * 1000, "tc_ms": statistics.median(tb) * 1000,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rounds": rounds, "block": block}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(int(cfg["threads"]))
    phases = {"import_torch": time.perf_counter() - t0}
    breakdown: dict = {}  # aotc-cold: the compile by phase and by step
    from aotc.model.build import build_model, by_name, make_inputs
    from aotc.manifest import load_manifest

    m = load_manifest(cfg["manifest"])
    t = time.perf_counter()
    model = by_name(build_model(m), m)  # called as aotc calls it: by the inputs' names
    phases["build_model"] = time.perf_counter() - t
    x = make_inputs(m, int(cfg["first_tokens"]), seed=0)
    mode = cfg["mode"]
    t = time.perf_counter()
    if mode == "eager":
        fn = model
    elif mode == "steady-pair":
        import aotc

        # like for like: the sizes aotc serves with static artifacts against torch.compile's
        # static graphs (dynamic=False: one per size), the others dynamic against dynamic
        tc_fn = torch.compile(model, dynamic=bool(cfg.get("tc_dynamic", True)))
        fn = aotc.load(m, model=model, store=cfg["store"])
    elif mode.startswith("tc-"):
        if mode == "tc-mega":
            torch.compiler.load_cache_artifacts(open(cfg["mega_load"], "rb").read())
        fn = torch.compile(model, dynamic=True)
    else:
        import aotc

        if mode == "aotc-cold":
            res = aotc.compile(m, store=cfg["store"], force=True, jobs=int(cfg.get("aotc_jobs", 1)))
            phases["aotc_compile"] = time.perf_counter() - t
            breakdown = {"phases": res.seconds, "steps": res.profile, "compiles": res.compiles}
        t_load = time.perf_counter()
        fn = aotc.load(m, model=model, store=cfg["store"], remote=cfg.get("remote"))
        phases["aotc_load"] = time.perf_counter() - t_load
        if "pull" in fn.timings.phases:
            phases["aotc_pull"] = fn.timings.phases["pull"]
        phases["aotc_resolve"] = fn.timings.phases.get("resolve", 0.0)  # toolchain facts, lookup
    phases["prepare"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        y = fn(*x)
    first_output_at = time.time()
    phases["first_call"] = time.perf_counter() - t
    at_first_output = _counters()
    steady: dict[str, float] = {}
    pair: dict[str, dict[str, float]] = {}
    if mode == "steady-pair":
        with torch.no_grad():
            for n in cfg["steady_sizes"]:
                pair[str(n)] = _paired(fn, tc_fn, make_inputs(m, int(n), seed=1),
                                       rounds=int(cfg.get("pair_rounds", 12)), block=5)
    with torch.no_grad():
        for n in ([] if mode == "steady-pair" else cfg["steady_sizes"]):
            xs = make_inputs(m, int(n), seed=1)
            for _ in range(3):
                fn(*xs)
            times = []
            for _ in range(int(cfg["steady_iters"])):
                t = time.perf_counter()
                fn(*xs)
                times.append(time.perf_counter() - t)
            steady[str(n)] = statistics.median(times) * 1000
    if cfg.get("mega_save"):
        data, _info = torch.compiler.save_cache_artifacts()
        open(cfg["mega_save"], "wb").write(data)
    print(json.dumps({
        "mode": mode, "first_output_at": first_output_at, "first_line_at": FIRST_LINE_AT,
        "phases": phases, "steady_ms": steady, "output_shape": list(y.shape), "pair": pair,
        "counters_first_output": at_first_output, "counters_end": _counters(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pulled_bytes": getattr(getattr(fn, "timings", None), "pulled_bytes", 0),
        "compile_breakdown": breakdown,
    }))


if __name__ == "__main__":
    main()
