"""Cold compile time and Inductor compile count of toy-llama at several depths, 6 shapes each
(dynamic + compile sizes 1, 2, 4, 8, 16), each in a fresh process with an empty store.

    python bench/compile.py [--layers 2,8,32] [--hidden 256] [--json]

Because identical layers give identical pieces, compiles stay 3 x 6 = 18 whatever the depth, and
the time should barely grow with depth (target: 32 layers <= 1.2x the time of 2 layers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def manifest(tmp: Path, layers: int, hidden: int) -> Path:
    data = yaml.safe_load((ROOT / "manifests" / "toy-llama.yaml").read_text())
    data["name"] = f"toy-llama-{layers}"
    data["model"]["kwargs"].update(layers=layers, hidden=hidden)
    path = tmp / f"toy-{layers}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def compile_cold(path: Path, store: Path, jobs: int = 1) -> dict:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "aotc.cli", "--store", str(store), "compile",
                          str(path), "--json", "-q", "-j", str(jobs)], capture_output=True,
                         text=True, check=False)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"compile of {path} failed:\n{out.stderr}")
    res = json.loads(out.stdout)
    return {"wall_seconds": round(wall, 2), "compiles": res["compiles"], "pieces": res["pieces"],
            "unique_pieces": res["unique_pieces"], "phases": res["seconds"],
            "max_abs_err": res["max_abs_err"], "bytes_stored": res["bytes_stored"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--jobs", type=int, default=1, help="aotc compile -j (worker processes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="aotc-bench-compile-") as tmp:
        for layers in depths:
            rows[layers] = compile_cold(manifest(Path(tmp), layers, args.hidden),
                                        Path(tmp) / f"store-{layers}", args.jobs)
    base = rows[depths[0]]["wall_seconds"]
    for r in rows.values():
        r["time_vs_shallowest"] = round(r["wall_seconds"] / base, 3)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"cold compile, toy-llama hidden {args.hidden}, 6 shapes, -j {args.jobs}, "
          "fresh process + empty store each")
    print(f"{'layers':>6} {'pieces':>6} {'unique':>6} {'compiles':>8} {'wall s':>8} {'compile s':>9} {'ratio':>6}")
    for layers, r in rows.items():
        print(f"{layers:>6} {r['pieces']:>6} {r['unique_pieces']:>6} {r['compiles']:>8} "
              f"{r['wall_seconds']:>8.1f} {r['phases'].get('compile', 0):>9.1f} {r['time_vs_shallowest']:>6.2f}")


if __name__ == "__main__":
    main()
