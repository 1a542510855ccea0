"""N replicas booting at once compile once: ``aotc compile`` of the toy manifest in N fresh
processes started together, each with an empty local store and its own Inductor cache, all
pointed at one remote (an S3-compatible server on loopback, moto's) — against one compile alone.

    python -m bench.single_flight [--replicas 4] [--layers 2] [--out DIR]

Figures: Inductor compiles in total (one set expected), the slowest replica's wall time over
the lone compile's, and what each replica did. Writes ``results/single_flight.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _manifest(work: Path, layers: int) -> Path:
    import yaml

    data = {"name": f"toy-{layers}", "model": {"factory": "aotc.models.toy_llama:build",
                                               "kwargs": {"layers": layers, "hidden": 64, "heads": 4, "vocab": 128}},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 128},
                       {"name": "positions", "dtype": "int64", "shape": ["tokens"], "fill": "arange"}],
            "compile_sizes": [1, 8], "max_tokens": 256, "splitting_ops": ["aotc::attention"]}
    path = work / "toy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start(manifest: Path, d: Path, env: dict[str, str]) -> tuple[subprocess.Popen, float]:
    d.mkdir(parents=True)
    full = {**env, "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TMPDIR": str(d)}
    proc = subprocess.Popen([sys.executable, "-m", "aotc.cli", "--store", str(d / "store"), "compile",
                             str(manifest), "--json", "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)
    return proc, time.perf_counter()


def _finish(proc: subprocess.Popen, t0: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"aotc compile failed: {err[-2000:]}")
    r = json.loads(out)
    return {"wall_s": round(time.perf_counter() - t0, 2), "hit": r["hit"], "compiles": r["compiles"],
            "pull_s": round(r["seconds"].get("pull", 0.0), 2)}


def run(replicas: int, layers: int, say: Any = print) -> dict[str, Any]:
    """The lone compile, then ``replicas`` at once on a fresh remote prefix."""
    from bench.sidebyside import remote_store

    with tempfile.TemporaryDirectory(prefix="aotc-bench-sf-") as tmp:
        work = Path(tmp)
        manifest = _manifest(work, layers)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AOTC_", "TORCHINDUCTOR_"))}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
                   AOTC_ALLOW_UNSIGNED="1")  # one trust domain here; signatures are measured elsewhere
        with remote_store(work, env) as remote:
            lone = _finish(*_start(manifest, work / "lone", {**env, "AOTC_REMOTE": f"{remote}/lone"}))
            say(f"  one compile alone        {lone['wall_s']:7.2f}s  ({lone['compiles']} Inductor compiles)")
            started = [_start(manifest, work / f"r{i}", {**env, "AOTC_REMOTE": f"{remote}/fleet"})
                       for i in range(replicas)]
            fleet = [_finish(p, t) for p, t in started]
    for i, r in enumerate(fleet):
        say(f"  replica {i}: {'pulled' if r['hit'] else 'compiled'} in {r['wall_s']:7.2f}s "
            f"({r['compiles']} compiles)")
    slowest = max(r["wall_s"] for r in fleet)
    return {"replicas": replicas, "layers": layers, "lone": lone, "fleet": fleet,
            "compiles_total": sum(r["compiles"] for r in fleet), "compiles_one": lone["compiles"],
            "slowest_over_one": round(slowest / lone["wall_s"], 3)}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"{r['replicas']} replicas of `aotc compile` (toy, {r['layers']} layers) started at once, "
             "empty local stores, one remote:", "",
             "| | wall s | Inductor compiles |", "|---|---|---|",
             f"| one compile alone | {r['lone']['wall_s']:.2f} | {r['lone']['compiles']} |"]
    lines += [f"| replica {i} ({'pulled' if x['hit'] else 'compiled'}) | {x['wall_s']:.2f} | {x['compiles']} |"
              for i, x in enumerate(r["fleet"])]
    lines += ["", f"- compiles in total: {r['compiles_total']} (one compile: {r['compiles_one']}); "
              f"slowest replica / one compile: {r['slowest_over_one']}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()
    print(f"single flight ({a.replicas} replicas at once):")
    r = run(a.replicas, a.layers)
    md = markdown(r)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "single_flight.json").write_text(json.dumps(r, indent=1))
    (a.out / "single_flight.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
