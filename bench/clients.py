"""The second client corpus's warm first call, side by side, one run.

    python -m bench.clients [--cases a,b,…] [--runs N] [--out DIR]

Each client of ``tests/helpers/clients_more_run.py`` (a CNN with max-pool and BatchNorm, a bf16
model, ``torch.cond``, a torchao int8 Llama, a training step; ``--cases`` picks others) runs in a
fresh process per contender: eager (no ``torch.compile``), dynamo-only (``backend="eager"``:
Dynamo's trace, the floor of every backend), Inductor cold (empty Inductor dir and TMPDIR) and
warm (the same dirs again), aotc cold (empty store, Inductor dir and TMPDIR) and warm (that store,
a NEW empty Inductor dir). The figure is the case's seconds in its process: building the model
(and quantizing it: torchao's case), its eager reference calls, and the compiled calls, whose
first call dominates (compile or load). The eager contender's seconds are the same case without
``torch.compile``, so a contender's *first-call cost* is its seconds minus eager's. Also whether
aotc served it (its warm run compiled nothing and hit the store). Medians over ``--runs``.
Goal per client: aotc warm ≤ Inductor warm, and aotc warm's first-call cost ≤ 2 s (Dynamo's
trace included: ``dynamo-only`` shows it). Writes ``clients.json``/``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HELPER = ROOT / "tests" / "helpers" / "clients_more_run.py"
DEFAULT_CASES = ("cnn-maxpool", "bf16-model", "cond", "torchao-int8", "train-step")
CONTENDERS = ("eager", "dynamo-only", "inductor-cold", "inductor-warm", "aotc-cold", "aotc-warm")
GOAL_SECONDS = 2.0


def _run(case: str, backend: str, env: dict[str, str]) -> dict[str, Any]:
    full = {**os.environ, **env, "CLIENTS_MORE_BACKEND": backend, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(HELPER), case], capture_output=True, text=True,
                         env=full, timeout=900)
    if res.returncode != 0:
        return {"error": res.stderr[-400:]}
    out = json.loads(res.stdout.strip().splitlines()[-1])["cases"][case]
    return {k: out.get(k) for k in ("seconds", "compiles", "hits", "inductor_compiles", "error", "max_err")}


def one_round(case: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """Every contender once for ``case``, each in a fresh process with its own dirs."""
    def dirs(name: str) -> dict[str, str]:
        (tmp / name / "t").mkdir(parents=True, exist_ok=True)
        return {"TORCHINDUCTOR_CACHE_DIR": str(tmp / name / "inductor"), "TMPDIR": str(tmp / name / "t")}

    store = {"AOTC_STORE": str(tmp / "store"), "AOTC_FALLBACK": "error"}
    got = {"eager": _run(case, "none", dirs("eager")),
           "dynamo-only": _run(case, "eager", dirs("dynamo"))}
    got["inductor-cold"] = _run(case, "inductor", dirs("inductor"))
    got["inductor-warm"] = _run(case, "inductor", dirs("inductor"))
    got["aotc-cold"] = _run(case, "aotc", {**dirs("aotc-cold"), **store})
    got["aotc-warm"] = _run(case, "aotc", {**dirs("aotc-warm"), **store})
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    from bench.report import byte_compile_aotc

    byte_compile_aotc()  # as installed: aotc's bytecode written once, not per start
    results: dict[str, Any] = {}
    for case in args.cases.split(","):
        rounds = []
        for _ in range(args.runs):
            tmp = Path(tempfile.mkdtemp(prefix="bench-clients-"))
            try:
                rounds.append(one_round(case, tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        med = {c: statistics.median(r[c]["seconds"] for r in rounds) if all(
            r[c].get("seconds") is not None for r in rounds) else None for c in CONTENDERS}
        warm = rounds[-1]["aotc-warm"]
        served = not warm.get("error") and warm.get("compiles") == 0 and (warm.get("hits") or 0) >= 1
        aw, iw, ea = med["aotc-warm"], med["inductor-warm"], med["eager"]
        first = None if aw is None or ea is None else round(aw - ea, 2)
        results[case] = {"seconds": med, "served": served, "rounds": rounds,
                         "aotc_warm_over_inductor_warm": None if not (aw and iw) else round(aw / iw, 3),
                         "aotc_warm_first_call_cost": first,
                         "goal_met": bool(served and aw is not None and iw is not None and first is not None
                                          and aw <= iw and first <= GOAL_SECONDS)}
        print(f"{case}: {json.dumps(med)} served={served}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "clients.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    lines = ["# Clients: warm first call (bench/clients.py)", "",
             f"Seconds per client in a fresh process (median of {args.runs}); first-call cost = a "
             f"contender's seconds minus eager's. Goal: aotc warm ≤ Inductor warm and its first-call "
             f"cost ≤ {GOAL_SECONDS:g} s, served by aotc (no fallback).", "",
             "| client | eager | dynamo-only | inductor cold | inductor warm | aotc cold | aotc warm "
             "| aotc warm / inductor warm | aotc warm first-call cost | served | goal |", "|" + "---|" * 11]
    for case, r in results.items():
        s = r["seconds"]
        cells = [f"{s[c]:.2f}" if s[c] is not None else "error" for c in CONTENDERS]
        ratio = r["aotc_warm_over_inductor_warm"]
        first = r["aotc_warm_first_call_cost"]
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {ratio if ratio is not None else '-'} | "
                     f"{first if first is not None else '-'} | {'yes' if r['served'] else 'NO'} | "
                     f"{'met' if r['goal_met'] else 'not met'} |")
    (out / "clients.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
