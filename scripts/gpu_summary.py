"""One JSON record of a GPU check run (``scripts/gpu-check.sh``): its steps, the CUDA graph
table first (the figure the check exists for), then the compile, the warm start and the tests.

    python scripts/gpu_summary.py OUT_DIR MODE WALL_SECONDS > OUT_DIR/summary.json

Reads what the steps left in OUT_DIR; a step that failed or left nothing is reported as such,
never as a crash of this script.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"unreadable": f"{path.name}: {type(e).__name__}: {e}"[:300]}


def _steps(out: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").is_file() else []:
        name, rc, seconds, limit = line.split("\t")
        rows.append({"step": name, "rc": int(rc), "seconds": int(seconds), "limit": int(limit),
                     "timed_out": int(rc) in (124, 137)})
    return rows


def _tests(xml: Path) -> dict[str, Any]:
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError) as e:
        return {"unreadable": f"{xml.name}: {e}"[:200]}
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"] + total["errors"], "skipped": total["skipped"], "failing": failed[:20]}


def _graph_table(bench: Any) -> dict[str, Any]:
    """Per size: eager and each mode's latency (ms), the speedup of piecewise over no graphs,
    each mode's largest error against eager; per mode: capture seconds and pool bytes."""
    if not isinstance(bench, dict) or "modes" not in bench:
        return {"missing": bench}
    modes = bench["modes"]
    rows = []
    for n in bench.get("sizes", []):
        k = str(n)
        row: dict[str, Any] = {"tokens": n, "eager_ms": bench.get("eager_ms", {}).get(k)}
        for mode, m in modes.items():
            row[f"{mode}_ms"] = m.get("ms", {}).get(k) if "ms" in m else None
            row[f"{mode}_max_abs_err"] = m.get("max_abs_err", {}).get(k) if "max_abs_err" in m else None
        if row.get("none_ms") and row.get("piecewise_ms"):
            row["piecewise_speedup_vs_none"] = round(row["none_ms"] / row["piecewise_ms"], 3)
        rows.append(row)
    capture = {mode: (m.get("graphs") or {}) if "graphs" in m else {k: v for k, v in m.items() if k != "phases"}
               for mode, m in modes.items()}
    return {"device": bench.get("device"), "torch": bench.get("torch"), "rows": rows,
            "capture": {mode: {"seconds": c.get("seconds"), "pool_bytes": c.get("pool_bytes"),
                               "graphs": c.get("graphs"), **({"note": c} if "seconds" not in c else {})}
                        for mode, c in capture.items()}}


def main() -> None:
    out, mode, wall = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    compiled, warm = _json(out / "compile.json"), _json(out / "warm_start.json")
    summary = {
        "mode": mode, "wall_seconds": wall,
        "cuda_graphs": _graph_table(_json(out / "cuda_graphs.json")),
        "compile": {k: compiled.get(k) for k in ("key", "hit", "pieces", "unique_pieces", "compiles",
                                                 "seconds", "max_abs_err", "unreadable") if k in compiled},
        "warm_start": {k: warm.get(k) for k in ("load_seconds", "first_call", "compiles", "traces",
                                                "fast_loads", "cudagraphs", "unreadable") if k in warm}
        | ({"sizes": {n: {"seconds": v.get("seconds"), "max_abs_err": v.get("max_abs_err")}
                      for n, v in warm["sizes"].items()}} if isinstance(warm.get("sizes"), dict) else {}),
        "tests_cuda": _tests(out / "tests_cuda.xml"),
        "tests": _tests(out / "tests.xml"),
        "steps": _steps(out),
    }
    summary["ok"] = all(s["rc"] == 0 for s in summary["steps"])
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
