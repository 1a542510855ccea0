"""Ratios, targets and the markdown table of a bench/sidebyside.py run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NAMES = {"eager": "eager", "tc-cold": "torch.compile cold", "tc-warm": "torch.compile warm",
         "tc-mega": "torch.compile + Mega-Cache", "aotc-cold": "aotc cold",
         "aotc-warm": "aotc warm", "aotc-remote": "aotc warm, pulled from the remote (empty local store)"}


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios_and_targets(results: dict[str, Any]) -> dict[str, Any]:
    """The ratios the issue asks for and each target's met / not met (None: not measured)."""
    c = results["contenders"]
    eager = c["eager"]["ttfo_median"] if "eager" in c else None

    def overhead(name: str) -> float | None:
        if name not in c or eager is None:
            return None
        return c[name]["ttfo_median"] - eager

    loader = c.get("aotc-warm", {}).get("phases", {}).get("aotc_load")
    cold = results["cold_compile_s"]
    main_key = f"{results['config']['layers']}L-{len(results['config']['compile_sizes'])}s"
    steady = {}
    pair = results.get("steady_pair") or {}
    if pair:  # measured side by side in one process (alternating blocks): the fair ratio
        steady = {n: p["ratio"] for n, p in pair.items()}
    elif "aotc-warm" in c and "tc-warm" in c:  # separate processes (older results files)
        for n, ms in c["aotc-warm"]["steady_ms"].items():
            steady[n] = _div(ms, c["tc-warm"]["steady_ms"].get(n))
    # depth scaling at one compile size (the 8L-1s point is shared with the size scaling); the
    # older results files measured it at 5 sizes
    scaling = _div(cold.get("32L-1s"), cold.get("2L-1s")) or _div(cold.get("32L-5s"), cold.get("2L-5s"))
    tc_cold = overhead("tc-cold")  # torch.compile's whole cold cost over eager: trace + compile
    dyn_key = f"{results['config']['layers']}L-0s"
    ratios = {
        "aotc_cold_compile_over_tc_cold": _div(cold.get(main_key), tc_cold),
        "aotc_cold_dynamic_only_over_tc_cold": _div(cold.get(dyn_key), tc_cold),
        "overhead_s": {k: overhead(k) for k in c},
        "aotc_loader_s": loader,
        "aotc_loader_over_cold_compile": _div(loader, cold.get(main_key)),
        "aotc_warm_over_tc_warm_overhead": _div(overhead("aotc-warm"), overhead("tc-warm")),
        "aotc_warm_over_mega_overhead": _div(overhead("aotc-warm"), overhead("tc-mega")),
        "aotc_steady_over_tc_steady": steady,
        "cold_compile_32L_over_2L": scaling,
    }
    if "aotc-remote" in c and "aotc-warm" in c:  # the fleet figures: pull-through vs local
        remote, pushes = c["aotc-remote"], results.get("pushes") or []
        ratios["remote"] = {
            "ttfo_over_local_warm": _div(remote["ttfo_median"], c["aotc-warm"]["ttfo_median"]),
            "load_s": remote["phases"].get("aotc_load"), "pull_s": remote["phases"].get("aotc_pull"),
            "resolve_s": remote["phases"].get("aotc_resolve"),
            "local_resolve_s": c["aotc-warm"]["phases"].get("aotc_resolve"),
            "local_load_s": loader, "pulled_bytes": remote.get("pulled_bytes"),
            "push_s": pushes[-1]["seconds"] if pushes else None,
            "pushed_bytes": pushes[-1]["bytes"] if pushes else None,
            "pushed_blobs": pushes[-1]["blobs"] if pushes else None}

    def le(value: float | None, limit: float) -> bool | None:
        return None if value is None else value <= limit

    steady_vals = [v for v in steady.values() if v is not None]
    targets = {
        "aotc warm overhead <= 0.05x torch.compile warm overhead":
            (ratios["aotc_warm_over_tc_warm_overhead"], le(ratios["aotc_warm_over_tc_warm_overhead"], 0.05)),
        "aotc loader <= 0.02x aotc cold compile":
            (ratios["aotc_loader_over_cold_compile"], le(ratios["aotc_loader_over_cold_compile"], 0.02)),
        "aotc loader <= 0.3 s": (loader, le(loader, 0.3)),
        "steady state <= 1.0x torch.compile at every size, like for like":
            (max(steady_vals) if steady_vals else None,
             le(max(steady_vals), 1.0) if steady_vals else None),
        "cold compile 32 layers / 2 layers <= 1.2": (scaling, le(scaling, 1.2)),
        "aotc cold compile (dynamic + sizes) <= 0.7x torch.compile cold":
            (ratios["aotc_cold_compile_over_tc_cold"], le(ratios["aotc_cold_compile_over_tc_cold"], 0.7)),
        "aotc cold compile (dynamic only) <= 0.4x torch.compile cold":
            (ratios["aotc_cold_dynamic_only_over_tc_cold"], le(ratios["aotc_cold_dynamic_only_over_tc_cold"], 0.4)),
    }
    return {"ratios": ratios, "targets": {k: {"value": v, "met": m} for k, (v, m) in targets.items()}}


def fmt(v: Any, spec: str = ".2f") -> str:
    """``v`` formatted by ``spec``; "–" for a figure not measured (None)."""
    return "–" if v is None else format(v, spec)


def markdown(results: dict[str, Any]) -> str:
    """The results as a markdown document: machine, contender table, ratios, targets."""
    m, cfg, c = results["machine"], results["config"], results["contenders"]
    lines = [
        f"### aotc side by side — {m['date']}",
        "",
        f"{m['cpu']}, {m['cores']} cores, {cfg['threads']} threads · torch {m['torch']} · "
        f"Python {m['python']} · toy-llama {cfg['layers']} layers (hidden {cfg['hidden']}), "
        f"compile sizes {cfg['compile_sizes']} · first input {cfg['first_tokens']} tokens · "
        f"{cfg['runs']} fresh process(es) per contender",
        "",
        "| contender | time to first output s (min–max) | overhead vs eager s | prepare s | "
        "first call s | peak RSS MB | " + " | ".join(f"steady {n} tok ms" for n in cfg["steady_sizes"])
        + " | Inductor compiles | Dynamo frames |",
        "|---|---|---|---|---|---|" + "---|" * len(cfg["steady_sizes"]) + "---|---|",
    ]
    over = results["ratios"]["overhead_s"]
    for key, s in c.items():
        steady = " | ".join(fmt(s["steady_ms"].get(str(n)), ".3f") for n in cfg["steady_sizes"])
        lines.append(
            f"| {NAMES.get(key, key)} | {s['ttfo_median']:.2f} ({s['ttfo_min']:.2f}–{s['ttfo_max']:.2f}) "
            f"| {fmt(over.get(key))} | {s['phases'].get('prepare', 0):.2f} | "
            f"{s['phases'].get('first_call', 0):.3f} | {s['peak_rss_mb']:.0f} | {steady} | "
            f"{s['counters']['inductor_compiles']} | {s['counters']['dynamo_frames']} |")
    r = results["ratios"]
    lines += ["", "Cold compile (aotc, s): " + ", ".join(
        f"{k} {v:.1f}" for k, v in results["cold_compile_s"].items()), ""]
    b = results.get("cold_compile_breakdown")
    if b:  # where a cold compile's time goes: the journey's phases, then the piece compiles by step
        lines += ["Cold compile by phase (s): " + ", ".join(f"{k} {v:.1f}" for k, v in b["phases"].items())
                  + f" · {b['compiles']} Inductor compiles, by step summed over them (s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in b["steps"].items()), ""]
    lines += [
        "| ratio | value |", "|---|---|",
        f"| aotc loader s (import aotc → runnable, excl. import torch and model build) | {fmt(r['aotc_loader_s'], '.3f')} |",
        f"| aotc loader / aotc cold compile | {fmt(r['aotc_loader_over_cold_compile'], '.4f')} |",
        f"| aotc warm overhead / torch.compile warm overhead | {fmt(r['aotc_warm_over_tc_warm_overhead'], '.3f')} |",
        f"| aotc warm overhead / Mega-Cache warm overhead | {fmt(r['aotc_warm_over_mega_overhead'], '.3f')} |",
    ]
    pair = results.get("steady_pair") or {}
    for n, v in r["aotc_steady_over_tc_steady"].items():
        p = pair.get(n)
        like = f"{p['like']} vs {p['like']}, " if p and p.get("like") else ""
        how = (f" ({like}one process, {p['rounds']} alternating rounds: {p['aotc_ms']:.3f} vs "
               f"{p['tc_ms']:.3f} ms, round ratios {p['ratio_min']:.2f}–{p['ratio_max']:.2f})") if p else ""
        lines.append(f"| aotc steady / torch.compile warm steady, {n} tokens{how} | {fmt(v, '.3f')} |")
    rem = r.get("remote")
    if rem:
        lines += [
            f"| aotc warm from the remote / from the local store, time to first output | {fmt(rem['ttfo_over_local_warm'], '.3f')} |",
            f"| aotc loader s: pulling through the remote (of which pull; lookup incl. this machine's first toolchain facts) vs local (lookup) | {fmt(rem['load_s'], '.3f')} ({fmt(rem['pull_s'], '.3f')}; {fmt(rem['resolve_s'], '.3f')}) vs {fmt(rem['local_load_s'], '.3f')} ({fmt(rem['local_resolve_s'], '.3f')}) |",
            f"| bytes moved: pulled by a replica / pushed by the build machine (blobs, push s) | {rem['pulled_bytes']:.0f} / {rem['pushed_bytes']} ({rem['pushed_blobs']}, {fmt(rem['push_s'])}) |"]
    lines += [f"| cold compile 32 layers / 2 layers | {fmt(r['cold_compile_32L_over_2L'], '.3f')} |",
              "", "| target | value | met |", "|---|---|---|"]
    for name, t in results["targets"].items():
        met = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        lines.append(f"| {name} | {fmt(t['value'], '.3f')} | {met} |")
    lines.append("")
    return "\n".join(lines)


def byte_compile_aotc() -> None:
    """Write aotc's bytecode (``__pycache__``) as an installed package has it: a wheel's install
    compiles it, an editable checkout under ``PYTHONDONTWRITEBYTECODE`` (this machine) never
    does, and every fresh process would compile aotc's ~70 modules again (~0.08 s of a warm
    start measured) while torch's and transformers' bytecode comes precompiled."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for package in ("aotc", "cache", "cli"):
        compileall.compile_dir(str(root / package), quiet=1)


def write_results(out: str | Path, stem: str, res: dict[str, Any], table: str) -> None:
    """``<out>/<stem>.json`` (``res``) and ``<stem>.md`` (``table``), printed too."""
    import json

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (path / f"{stem}.md").write_text(table)
    print(table)
