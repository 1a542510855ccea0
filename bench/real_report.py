"""Medians, ratios with their goals, and the markdown table of a bench/real.py run."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

FIELDS = ("first_token_from_spawn_s", "first_done_from_spawn_s", "first_s", "later_s", "load_s",
          "wall_s", "peak_rss_gb")
# (ratio, numerator (contender, field), denominator, op, goal) — issue #45's goals at 0.5B
GOALS = [
    ("precompiled warm spawn → first generate / eager's", ("precompiled-warm", "first_done_from_spawn_s"),
     ("eager", "first_done_from_spawn_s"), "<=", 1.1),
    ("aotc cold spawn → first generate / Inductor cold's", ("aotc-cold", "first_done_from_spawn_s"),
     ("inductor-cold", "first_done_from_spawn_s"), "<=", 0.4),
    ("aotc warm later generate() / Inductor warm's", ("aotc-warm", "later_s"),
     ("inductor-warm", "later_s"), "<=", 1.0),
    ("aotc cold peak RSS / eager's", ("aotc-cold", "peak_rss_gb"), ("eager", "peak_rss_gb"), "<=", 1.2),
    ("precompiled cold peak RSS / eager's", ("precompiled-cold", "peak_rss_gb"), ("eager", "peak_rss_gb"),
     "<=", 1.2),
    ("aotc compile (manifest) peak RSS / eager's", ("manifest-compile", "peak_rss_gb"),
     ("eager", "peak_rss_gb"), "<=", 1.2),
    ("aotc warm peak RSS / eager's", ("aotc-warm", "peak_rss_gb"), ("eager", "peak_rss_gb"), "<=", 1.05),
    ("precompiled warm peak RSS / eager's", ("precompiled-warm", "peak_rss_gb"), ("eager", "peak_rss_gb"),
     "<=", 1.05),
]


def summarize(got: dict[str, Any], args: Any, seconds: float) -> dict[str, Any]:
    """Medians per contender, tokens = eager's, the ratios against their goals, the machine."""
    import torch
    import transformers

    raw, pair = got["raw"], got["pair"]
    eager_tokens = [r.get("tokens") for r in raw.get("eager", [])]
    contenders: dict[str, Any] = {}
    for name, rs in raw.items():
        ok = [r for r in rs if "error" not in r]
        s: dict[str, Any] = {"runs": len(rs), "ok_runs": len(ok), "leftovers": max(r["leftovers"] for r in rs)}
        if len(ok) < len(rs):
            s["error"] = next(r["error"] for r in rs if "error" in r)
        for k in FIELDS:
            vals = [r[k] for r in ok if k in r]
            if vals:
                s[k] = statistics.median(vals)
        if ok:
            s["counters"] = ok[-1].get("counters", {})
        if any("tokens" in r for r in ok):
            s["tokens_equal_eager"] = all(r.get("tokens") in eager_tokens for r in ok)
        if any("tokens_equal" in r for r in ok):
            s["tokens_equal_eager"] = all(r.get("tokens_equal") for r in ok)
            s["max_abs_diff"] = max(r["max_abs_diff"] for r in ok)
        contenders[name] = s
    ratios = []
    # every child's peak RSS (wait4) is at least the bench process's own peak: where that is near
    # a contender's, the RSS figures measure the bench, not the contenders — not judged
    floor = got.get("bench_peak_rss_gb", 0.0)
    rss_floored = floor >= 0.5 * contenders.get("eager", {}).get("peak_rss_gb", float("inf"))
    for label, (a, fa), (b, fb), op, goal in GOALS:
        va, vb = contenders.get(a, {}).get(fa), contenders.get(b, {}).get(fb)
        v = None if va is None or not vb or (fa == "peak_rss_gb" and rss_floored) else va / vb
        ratios.append({"ratio": label, "value": v, "goal": f"{op} {goal}",
                       "met": None if v is None else (v <= goal if op == "<=" else v >= goal)})
    for what, label in (("decode", "aotc decode generate() time / Inductor's, paired"),
                        ("forward", "aotc dynamic forward at 256 tokens / Inductor's, paired"),
                        ("forward-toy", "the same at toy size (4 layers, hidden 128), paired")):
        v, goal = pair.get(what, {}).get("aotc_time_over_inductor"), 1.0
        ratios.append({"ratio": label, "value": v, "goal": f"<= {goal}",
                       "met": None if v is None else v <= goal})
    return {"machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
            "config": {"runs": args.runs, "cold_runs": args.cold_runs, "threads": args.threads,
                       "decode_rounds": args.decode_rounds},
            "contenders": contenders, "pair": pair, "ratios": ratios, "bench_seconds": seconds,
            "bench_peak_rss_gb": floor, "rss_floored": rss_floored,
            "raw": {k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in raw.items()}}


def markdown(res: dict[str, Any]) -> str:
    """The contenders' table, the paired figures and the ratios with their goals."""
    from bench.report import fmt as f

    m, c = res["machine"], res["config"]

    lines = [f"### A Qwen2-0.5B-shaped model (24 layers, 494 M parameters, float32) — {m['date']}", "",
             f"{m['cores']} cores, {c['threads']} threads · torch {m['torch']} · transformers "
             f"{m['transformers']} · `generate()` greedy, static cache, batch 1, 16-token prompt, 16 new "
             f"tokens · fresh process per contender, medians of {c['runs']} (cold ones: {c['cold_runs']}) · "
             f"no process left between contenders · bench {res['bench_seconds'] / 60:.1f} min", "",
             "| contender | spawn → first token s | spawn → first output s | first call s | later "
             "generate() s | peak RSS GB | Dynamo frames | Inductor compiles | tokens = eager | left behind |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["contenders"].items():
        if "error" in s and not s["ok_runs"]:
            lines.append(f"| {name} | failed: {s['error'].splitlines()[-1][:90]} |" + " – |" * 8)
            continue
        cnt = s.get("counters", {})
        first = s.get("first_s", s.get("load_s")) if name != "manifest-compile" else s.get("wall_s")
        eq = s.get("tokens_equal_eager")
        lines.append(f"| {name} | {f(s.get('first_token_from_spawn_s'))} | {f(s.get('first_done_from_spawn_s'))} | "
                     f"{f(first)} | {f(s.get('later_s'))} | {f(s.get('peak_rss_gb'))} | "
                     f"{cnt.get('dynamo_frames', '–')} | {cnt.get('inductor_compiles', '–')} | "
                     f"{'–' if eq is None else ('yes' if eq else '**no**')} | {s['leftovers']} |")
    p = res["pair"]
    if "error" in p:
        lines += ["", f"paired measurement failed: {p['error'].splitlines()[-1][:200]}"]
    else:
        lines += ["", "| paired in one process | aotc s | Inductor s | aotc / Inductor (median, min–max) | "
                  "equal |", "|---|---|---|---|---|"]
        for what, label in (("decode", "`generate()` (16 new tokens)"), ("forward", "dynamic forward, 256 tokens"),
                            ("forward-toy", "dynamic forward, 256 tokens, toy Llama (4 layers, hidden 128)")):
            q = p[what]
            lines.append(f"| {label} | {q['aotc_s']:.3f} | {q['inductor_s']:.3f} | "
                         f"{q['aotc_time_over_inductor']:.3f} ({q['min']:.3f}–{q['max']:.3f}) | "
                         f"{'yes' if q['equal'] else '**no**'} |")
    if res.get("rss_floored"):
        lines += ["", f"Peak RSS not judged: the bench's own process peaked at {res['bench_peak_rss_gb']:.2f} GB, "
                      "a floor under every child's figure (wait4)."]
    lines += ["", "| ratio | value | goal | met |", "|---|---|---|---|"]
    for r in res["ratios"]:
        met = {True: "met", False: "**not met**", None: "not measured"}[r["met"]]
        lines.append(f"| {r['ratio']} | {f(r['value'], '.3f')} | {r['goal']} | {met} |")
    return "\n".join(lines) + "\n"
