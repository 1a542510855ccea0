"""transformers' ``generate()`` with a compiled static-cache decode step, side by side, one run.

    python -m bench.hf_generate [--runs N] [--out DIR]

A tiny LlamaForCausalLM (seeded random weights, saved once with ``save_pretrained`` so every start
loads the same weights) generates greedily: batch 2, prompt 7 tokens, 32 new tokens,
``cache_implementation="static"``, ``compile_config=CompileConfig(backend=B)`` with
``_compile_all_devices = True`` (transformers compiles only on accelerators otherwise).
Contenders, each in a fresh process (its first call includes Dynamo, compile and load): eager (no
compile_config); dynamo-only (``backend="eager"``: Dynamo's trace and nothing else, the floor of
every backend's first call); inductor cold (empty Inductor cache dir and TMPDIR) and warm (the same dirs
again); aotc cold (empty AOTC_STORE, Inductor dir and TMPDIR) and warm (that store, a NEW empty
Inductor dir: aotc must not need Inductor's cache). Rounds interleave the contenders (``--runs``);
figures are medians per contender. The decode ratio is measured apart, paired in ONE process
(Inductor warm and aotc warm: alternating blocks of generate() calls), since process-to-process
decode figures here swing by more than the gap measured. Writes
``results/hf_generate.json`` and ``.md``.
"""

from __future__ import annotations

import time

SPAWN_LINE_AT = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONTENDERS = ("eager", "dynamo-only", "inductor-cold", "inductor-warm", "aotc-cold", "aotc-warm",
              "precompiled-cold", "precompiled-warm")
# figures without a goal: what any torch.compile backend pays before it is called (Dynamo's
# trace: torch.compile(backend="eager")), and the user's wait from process start
INFO = {"aotc_warm_first_over_dynamo_only_first": ("aotc-warm", "dynamo-only", "first_s"),
        "aotc_warm_start_to_first_over_eager": ("aotc-warm", "eager", "start_to_first_s"),
        "aotc_decode_over_inductor_decode_processes": ("aotc-warm", "inductor-warm", "decode_tok_s")}
# steady decode: the median of 15 generate() calls (~30 ms each here: 3 were too few on 2 noisy cores)
BATCH, PROMPT, NEW_TOKENS, STEADY_CALLS = 2, 7, 32, 15
GOALS = {"precompiled_warm_first_over_eager_first": ("<=", 1.2),
         "precompiled_warm_start_to_first_over_eager": ("<=", 1.1),
         "precompiled_decode_over_aotc_decode": (">=", 0.95),
         "aotc_warm_first_over_eager_first": ("<=", 1.2),
         "aotc_decode_over_inductor_decode": (">=", 1.0),
         "aotc_cold_first_over_inductor_cold_first": ("<=", 1.0)}


def make_model(path: Path) -> None:
    """The tiny Llama, seeded, saved to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)


def child(cfg: dict[str, Any]) -> None:
    """One contender in this fresh process; prints one JSON line (times, tokens)."""
    import torch
    from transformers import CompileConfig, LlamaForCausalLM

    torch.set_num_threads(int(cfg["threads"]))
    model = LlamaForCausalLM.from_pretrained(cfg["model"]).eval()
    ids = torch.randint(1, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    kwargs: dict[str, Any] = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, cache_implementation="static",
                                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    load_s = 0.0
    if cfg["backend"] == "precompiled":
        from aotc.dynamo_artifacts.hf import serve_generate

        t = time.perf_counter()
        serve_generate(model)  # the store from AOTC_STORE; CPU compile allowed on the model's config
        load_s = time.perf_counter() - t
    elif cfg["backend"]:
        cc = CompileConfig(backend=cfg["backend"])
        cc._compile_all_devices = True  # transformers compiles only on accelerators otherwise
        kwargs["compile_config"] = cc

    def gen() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, **kwargs)

    t = time.perf_counter()
    out = gen()
    first_done_at = time.time()
    first_s = time.perf_counter() - t
    times = []
    for _ in range(STEADY_CALLS):
        t = time.perf_counter()
        again = gen()
        times.append(time.perf_counter() - t)
        assert torch.equal(again, out), "steady call's tokens differ from the first call's"
    from bench.child import _counters  # Dynamo frames, Inductor compiles, aotc traces/compiles

    counters = _counters()
    print(json.dumps({"first_s": first_s, "first_done_at": first_done_at, "counters": counters,
                      "load_s": load_s,
                      "spawn_line_at": SPAWN_LINE_AT, "steady_s": statistics.median(times),
                      "tokens": out[:, PROMPT:].tolist()}))


def pair_child(cfg: dict[str, Any]) -> None:
    """Steady decode of several backends in ONE process (the machine's state is the same for
    all): a generate() per backend, each on its own copy of the model, then rounds that each run
    a block of every backend in a rotating order. Prints one JSON line: per backend its median
    generate() seconds and the median over rounds of its tokens/s over Inductor's."""
    import torch
    from transformers import CompileConfig, LlamaForCausalLM

    torch.set_num_threads(int(cfg["threads"]))
    ids = torch.randint(1, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    gens = {}
    for name, backend, configured in cfg["pair"]:
        model = LlamaForCausalLM.from_pretrained(cfg["model"]).eval()
        if configured:  # a configured aotc backend under transformers' own mode (like for like)
            import aotc

            backend = aotc.backend(**configured)
        cc = CompileConfig(backend=backend)
        cc._compile_all_devices = True  # transformers compiles only on accelerators otherwise
        kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      cache_implementation="static", attention_mask=torch.ones_like(ids),
                      pad_token_id=0, compile_config=cc)
        gens[name] = (model, kwargs)

    def gen(name: str) -> torch.Tensor:
        model, kwargs = gens[name]
        with torch.no_grad():
            return model.generate(ids, **kwargs)

    first = {name: gen(name) for name in gens}  # compiles or loads; then equal tokens or no figure
    ref = next(iter(gens))
    equal = {name: bool(torch.equal(first[name], first[ref])) for name in gens}
    for _ in range(2):
        for name in gens:
            gen(name)
    names = list(gens)
    times: dict[str, list[float]] = {n: [] for n in names}
    speed: dict[str, list[float]] = {n: [] for n in names}
    for r in range(int(cfg.get("rounds", 16))):
        med = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            block = []
            for _ in range(4):
                t = time.perf_counter()
                gen(name)
                block.append(time.perf_counter() - t)
            med[name] = statistics.median(block)
            times[name] += block
        for name in names:
            speed[name].append(med[ref] / med[name])
    print(json.dumps({name: {"generate_s": statistics.median(times[name]),
                             "speed_over_" + ref: statistics.median(speed[name]),
                             "speed_min": min(speed[name]), "speed_max": max(speed[name]),
                             "tokens_equal": equal[name]} for name in names}))


def run_child(cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """A fresh interpreter running :func:`child`; adds ``start_to_first_s`` (from spawn)."""
    spawned = time.time()
    p = subprocess.run([sys.executable, "-m", "bench.hf_generate", "--child", json.dumps(cfg)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        return {"error": f"exit {p.returncode}: " + "\n".join(lines[-8:])}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["start_to_first_s"] = res["first_done_at"] - spawned
    res["decode_tok_s"] = NEW_TOKENS * BATCH / res["steady_s"]
    return res


def run_pair(cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """A fresh interpreter running :func:`pair_child`; its figures, or ``{"error": …}``."""
    p = subprocess.run([sys.executable, "-m", "bench.hf_generate", "--child", json.dumps(cfg)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        return {"error": f"exit {p.returncode}: " + "\n".join(lines[-8:])}
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


# the paired decode measurement: Inductor warm and aotc warm
# (name, backend, aotc.backend(**kwargs) or None): every one under transformers' CompileConfig
# mode ("reduce-overhead": on CPU, Inductor drops its per-call input asserts under it)
PAIR: list[tuple[str, str, dict[str, Any] | None]] = [("inductor", "inductor", None), ("aotc", "aotc", None)]


def fresh(path: Path) -> Path:
    """``path`` emptied (``tmp`` inside it too: Inductor keeps precompiled headers in $TMPDIR)."""
    shutil.rmtree(path, ignore_errors=True)
    (path / "tmp").mkdir(parents=True)
    return path


def bench(work: Path, runs: int, threads: int) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every contender ``runs`` times, interleaved by round; cold ones from empty dirs each round.
    Then steady decode paired in one process (:func:`pair_child`) over the last round's warm
    Inductor dir and aotc store: the decode ratio's measurement (process to process, this
    machine's decode figures swing more than the difference being measured)."""
    model = work / "model"
    make_model(model)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "AOTC_"))}
    base.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for i in range(runs):
        say(f"round {i + 1}/{runs}")
        ind_tc, ind_a, ind_a2, store, pstore = (fresh(work / n) for n in ("ind-tc", "ind-a", "ind-a2", "store",
                                                                          "pstore"))
        plan = {"eager": (None, fresh(work / "ind-eager")),
                "dynamo-only": ("eager", fresh(work / "ind-dynamo")), "inductor-cold": ("inductor", ind_tc),
                "inductor-warm": ("inductor", ind_tc), "aotc-cold": ("aotc", ind_a),
                "aotc-warm": ("aotc", ind_a2), "precompiled-cold": ("precompiled", fresh(work / "ind-p")),
                "precompiled-warm": ("precompiled", fresh(work / "ind-p2"))}
        for name, (backend, ind) in plan.items():
            env = dict(base, TORCHINDUCTOR_CACHE_DIR=str(ind), TRITON_CACHE_DIR=str(ind / "triton"),
                       TMPDIR=str(ind / "tmp"), AOTC_STORE=str(pstore if backend == "precompiled" else store))
            res = run_child({"model": str(model), "backend": backend, "threads": threads}, env)
            raw[name].append(res)
            say(f"  {name:14s} " + (res["error"].splitlines()[0] if "error" in res else
                f"first generate {res['first_s']:6.2f}s, start->first {res['start_to_first_s']:6.2f}s, "
                f"decode {res['decode_tok_s']:7.1f} tok/s, {res['counters']}"))
    env = dict(base, TORCHINDUCTOR_CACHE_DIR=str(ind_tc), TRITON_CACHE_DIR=str(ind_tc / "triton"),
               TMPDIR=str(ind_tc / "tmp"), AOTC_STORE=str(store))
    pair = run_pair({"model": str(model), "threads": threads, "pair": PAIR}, env)
    say("  decode pair " + (pair["error"].splitlines()[0] if "error" in pair else ", ".join(
        f"{n} {v['speed_over_inductor']:.3f}x" for n, v in pair.items())))
    return raw, pair


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per contender; ``tokens_match_eager`` against eager's tokens of the same round."""
    eager = [r.get("tokens") for r in raw["eager"]]
    out: dict[str, Any] = {}
    for name, rs in raw.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out[name] = {"error": rs[-1]["error"] if rs else "not run"}
            continue
        out[name] = {k: statistics.median(r[k] for r in ok)
                     for k in ("first_s", "start_to_first_s", "decode_tok_s", "load_s")}
        out[name]["ok_runs"], out[name]["runs"] = len(ok), len(rs)
        out[name]["counters"] = ok[-1]["counters"]
        out[name]["tokens_match_eager"] = all(
            r.get("tokens") is not None and r.get("tokens") == e for r, e in zip(rs, eager))
        if len(ok) < len(rs):
            out[name]["error"] = next(r["error"] for r in rs if "error" in r)
    return out


def ratios(s: dict[str, Any], pair: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ratios, each with its goal and met / not met (None: not measured); the decode ratios
    from the paired measurement (``pair``)."""
    def get(name: str, key: str) -> float | None:
        return s.get(name, {}).get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    values = {"precompiled_warm_first_over_eager_first": div(get("precompiled-warm", "first_s"),
                                                             get("eager", "first_s")),
              "precompiled_warm_start_to_first_over_eager": div(get("precompiled-warm", "start_to_first_s"),
                                                                get("eager", "start_to_first_s")),
              "precompiled_decode_over_aotc_decode": div(get("precompiled-warm", "decode_tok_s"),
                                                         get("aotc-warm", "decode_tok_s")),
              "aotc_warm_first_over_eager_first": div(get("aotc-warm", "first_s"), get("eager", "first_s")),
              "aotc_decode_over_inductor_decode": pair.get("aotc", {}).get("speed_over_inductor"),
              "aotc_cold_first_over_inductor_cold_first": div(get("aotc-cold", "first_s"),
                                                              get("inductor-cold", "first_s"))}
    out = {}
    for k, v in values.items():
        op, goal = GOALS[k]
        met = None if v is None else (v <= goal if op == "<=" else v >= goal)
        out[k] = {"value": v, "goal": f"{op} {goal}", "met": met}
    for k, (a, b, field) in INFO.items():
        out[k] = {"value": div(get(a, field), get(b, field)), "goal": "–", "met": "info"}
    return out


def markdown(res: dict[str, Any]) -> str:
    """A small table, the ratios with their goals, and the machine."""
    from bench.report import fmt as f

    m = res["machine"]
    lines = [f"### transformers generate(), static cache, compiled decode step — {m['date']}", "",
             f"{m['cores']} cores, {res['config']['threads']} threads · torch {m['torch']} · "
             f"transformers {m['transformers']} · tiny Llama (4 layers, hidden 128) · batch {BATCH}, "
             f"prompt {PROMPT}, {NEW_TOKENS} new tokens, greedy · {res['config']['runs']} round(s), "
             f"fresh process per start · medians · bench {res['bench_seconds']:.0f} s", "",
             "| contender | first generate s | process start → first generate done s | "
             "decode tok/s | tokens = eager | Inductor compiles | Dynamo graphs traced |",
             "|---|---|---|---|---|---|---|"]
    for name, s in res["contenders"].items():
        if "first_s" not in s:
            lines.append(f"| {name} | failed: {s['error'].splitlines()[0][:80]} | – | – | – | – | – |")
            continue
        lines.append(f"| {name} | {s['first_s']:.2f} | {s['start_to_first_s']:.2f} | "
                     f"{s['decode_tok_s']:.1f} | {'yes' if s['tokens_match_eager'] else '**no**'} | "
                     f"{s['counters'].get('inductor_compiles')} | {s['counters'].get('dynamo_graphs')} |")
    lines += ["", "| ratio | value | goal | met |", "|---|---|---|---|"]
    names = {"precompiled_warm_first_over_eager_first": "aotc precompiled warm first generate / eager first generate",
             "precompiled_warm_start_to_first_over_eager": "aotc precompiled warm process start → first generate "
                                                           "done / eager's",
             "precompiled_decode_over_aotc_decode": "aotc precompiled decode tok/s / aotc (backend) warm decode tok/s",
             "aotc_warm_first_over_eager_first": "aotc warm first generate / eager first generate",
             "aotc_decode_over_inductor_decode": "aotc decode tok/s / inductor (warm) decode tok/s, paired "
                                                 "in one process",
             "aotc_decode_over_inductor_decode_processes": "the same, each in its own process (the table's "
                                                           "decode column)",
             "aotc_cold_first_over_inductor_cold_first": "aotc cold first generate / inductor cold first generate",
             "aotc_warm_first_over_dynamo_only_first": "aotc warm first generate / Dynamo's trace alone "
                                                       "(torch.compile backend=\"eager\") first generate",
             "aotc_warm_start_to_first_over_eager": "aotc warm process start → first generate done / eager's"}
    for k, r in res["ratios"].items():
        met = {True: "met", False: "**not met**", None: "not measured", "info": "–"}[r["met"]]
        lines.append(f"| {names[k]} | {f(r['value'], '.3f')} | {r['goal']} | {met} |")
    return "\n".join(lines) + "\n"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="rounds (each contender once per round)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        cfg = json.loads(args.child)
        pair_child(cfg) if "pair" in cfg else child(cfg)
        return {}
    from bench.report import byte_compile_aotc

    byte_compile_aotc()  # as installed: aotc's bytecode written once, not per start
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aotc-hfgen-") as tmp:
        raw, pair = bench(Path(tmp), args.runs, args.threads)
    import torch
    import transformers

    summary = summarize(raw)
    res = {"machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
           "config": {"runs": args.runs, "threads": args.threads, "batch": BATCH, "prompt": PROMPT,
                      "new_tokens": NEW_TOKENS, "steady_calls": STEADY_CALLS},
           "contenders": summary, "ratios": ratios(summary, pair), "decode_pair": pair,
           "raw": {k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in raw.items()},
           "bench_seconds": time.perf_counter() - t0}
    from bench.report import write_results

    write_results(args.out, "hf_generate", res, markdown(res))
    return res


if __name__ == "__main__":
    main()
