"""aotc side by side with eager and torch.compile's own caches, cold and warm, in one run.

    python -m bench.sidebyside            # full (from the repository root): toy-llama 8 layers x 5 compile sizes, 3 runs
                                          # each, plus compile scaling (2/8/32 layers at 1 size;
                                          # 1/5/10 sizes at 8 layers)
    python -m bench.sidebyside --quick    # <= 3 min: 2 layers, 1 compile size, 1 run each
    python -m bench.sidebyside --runs 1 --layers 2 --sizes 1 --no-scaling --out DIR

Every start is a fresh interpreter (bench/child.py) timed from its spawn to its first output
tensor, with the same model, weights, first input (7 tokens) and thread count. Contenders:
eager; torch.compile cold (empty Inductor cache and temp dirs) and warm (the same dirs, hot); torch.compile
with Mega-Cache (artifacts saved by a cold run, loaded into an empty cache dir); aotc cold
(``aotc compile -j THREADS`` into an empty store, then load) and warm (load from that store); aotc
remote (that store pushed to an S3-compatible server — moto's, on loopback — then a load into an
empty local store that pulls the entry through, verified). Writes
``results/latest.json`` (machine, every raw figure) and ``results/latest.md`` (the table,
ratios and targets, also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from bench.report import markdown, ratios_and_targets

CONTENDERS = ("eager", "tc-cold", "tc-warm", "tc-mega", "aotc-cold", "aotc-warm", "aotc-remote")
SIZE_SETS = {0: [], 1: [16], 5: [1, 2, 4, 8, 16], 10: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}


def write_manifest(tmp: Path, layers: int, n_sizes: int, hidden: int) -> Path:
    """toy-llama with ``layers`` layers and ``n_sizes`` compile sizes (see SIZE_SETS)."""
    data = yaml.safe_load((ROOT / "manifests" / "toy-llama.yaml").read_text())
    data["name"] = f"bench-toy-{layers}L-{n_sizes}s"
    data["model"]["kwargs"].update(layers=layers, hidden=hidden)
    data["compile_sizes"] = SIZE_SETS[n_sizes]
    data["store"] = None
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_child(cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Start one fresh interpreter; its result with ``ttfo`` = first output − spawn (seconds)."""
    spawned = time.time()
    out = subprocess.run([sys.executable, str(HERE / "child.py"), json.dumps(cfg)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=3600, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{cfg['mode']} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["ttfo"] = res["first_output_at"] - spawned
    res["interpreter_start"] = res["first_line_at"] - spawned
    return res


class Bench:
    """One configuration's contenders, each run ``runs`` times in fresh processes."""

    def __init__(self, manifest: Path, work: Path, runs: int, threads: int,
                 steady_sizes: list[int], steady_iters: int, machine_tmp: Path | None = None) -> None:
        self.manifest, self.work, self.runs, self.threads = manifest, work, runs, threads
        self.machine_tmp = machine_tmp  # one $TMPDIR for every start (--warm-machine)
        self.steady_sizes, self.steady_iters = steady_sizes, steady_iters
        self.pair: dict[str, Any] = {}  # the paired steady-state measurement (steady-pair)
        self.remote: str | None = None  # s3://bucket when the aotc-remote contender runs
        self.pushes: list[dict[str, Any]] = []
        self.base_env = {k: v for k, v in os.environ.items()
                         if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "AOTC_"))}
        self.base_env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))

    def _cfg(self, mode: str, store: Path, **extra: Any) -> dict[str, Any]:
        return {"mode": mode, "manifest": str(self.manifest), "store": str(store),
                "first_tokens": 7, "steady_sizes": self.steady_sizes,
                "steady_iters": self.steady_iters, "threads": self.threads,
                "aotc_jobs": self.threads, **extra}  # `aotc compile -j`: Inductor's workers too

    def _env(self, inductor_dir: Path) -> dict[str, str]:
        # the temp dir goes with the cache dir: Inductor keeps its machine-wide precompiled C++
        # headers (and aotc its ISA probe libraries) under $TMPDIR, so "cold" is cold there too
        tmp = self.machine_tmp or inductor_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return dict(self.base_env, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir),
                    TRITON_CACHE_DIR=str(inductor_dir / "triton"), TMPDIR=str(tmp))

    def _fresh(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def contenders(self, only: tuple[str, ...] = CONTENDERS) -> dict[str, list[dict[str, Any]]]:
        """Run every contender ``runs`` times (cold ones from empty caches each time)."""
        out: dict[str, list[dict[str, Any]]] = {m: [] for m in only}
        mega = self.work / "mega.bin"
        for i in range(self.runs):
            say(f"run {i + 1}/{self.runs}")
            if "eager" in only:
                out["eager"].append(self._one("eager", self._fresh("ind-eager"), self.work / "none"))
            ind = self._fresh("ind-tc")
            if {"tc-cold", "tc-warm", "tc-mega"} & set(only):
                out.setdefault("tc-cold", []).append(
                    self._one("tc-cold", ind, self.work / "none", mega_save=str(mega)))
            if "tc-warm" in only:
                out["tc-warm"].append(self._one("tc-warm", ind, self.work / "none"))
            if "tc-mega" in only:
                out["tc-mega"].append(self._one("tc-mega", self._fresh("ind-mega"),
                                                self.work / "none", mega_load=str(mega)))
            store = self._fresh("store")
            if {"aotc-cold", "aotc-warm", "aotc-remote"} & set(only):
                out.setdefault("aotc-cold", []).append(
                    self._one("aotc-cold", self._fresh("ind-aotc"), store))
            if "aotc-warm" in only:
                out["aotc-warm"].append(self._one("aotc-warm", self._fresh("ind-aotc2"), store))
            if "aotc-remote" in only and self.remote:
                url = f"{self.remote}/run{i}"
                self.pushes.append(self._push(store, url))
                out["aotc-remote"].append(self._one("aotc-remote", self._fresh("ind-aotc3"),
                                                    self._fresh("replica"), remote=url,
                                                    env={"AOTC_TRUST_KEYS": self._signer()[1]}))
            if i == self.runs - 1 and self.steady_sizes and {"tc-warm", "aotc-warm"} <= set(only):
                self.pair = self._steady_pair(store, ind)
        return {k: v for k, v in out.items() if k in only}

    def _steady_pair(self, store: Path, ind: Path) -> dict[str, Any]:
        """The steady-state ratio, like for like: both warm, one process, alternating blocks; the
        sizes aotc has static artifacts for against torch.compile with static shapes, the others
        against torch.compile's dynamic graph (one process each)."""
        sizes = set(yaml.safe_load(self.manifest.read_text())["compile_sizes"])
        pair: dict[str, Any] = {}
        for like, want in (("static", True), ("dynamic", False)):
            steady = [n for n in self.steady_sizes if (n in sizes) == want]
            if steady:
                cfg = dict(self._cfg("steady-pair", store), steady_sizes=steady, tc_dynamic=like == "dynamic")
                got = run_child(cfg, self._env(ind))["pair"]
                pair.update({n: dict(p, like=like) for n, p in got.items()})
        say("  steady-pair " + ", ".join(f"{n} tok ({p['like']}) {p['ratio']:.3f}" for n, p in pair.items()))
        return {n: pair[n] for n in sorted(pair, key=int)}

    def _one(self, mode: str, inductor_dir: Path, store: Path, env: dict[str, str] | None = None,
             **extra: Any) -> dict[str, Any]:
        res = run_child(self._cfg(mode, store, **extra), {**self._env(inductor_dir), **(env or {})})
        pulled = f", pulled {res['pulled_bytes']} B" if res.get("pulled_bytes") else ""
        say(f"  {mode:10s} first output {res['ttfo']:7.2f}s  (compiles "
            f"{res['counters_end']['inductor_compiles']}, traces {res['counters_end']['dynamo_frames']}{pulled})")
        return res

    def _signer(self) -> tuple[Path, str]:
        """The build machine's signing key (made once) and its public key, which the replicas
        trust: entries crossing machines need a trusted signature by default."""
        path = self.work / "signing.key"
        if not path.is_file():
            from aotc.fleet.trust import generate_key

            generate_key(path)
        from aotc.fleet.trust import public_key_of

        return path, public_key_of(path)

    def _push(self, store: Path, url: str) -> dict[str, Any]:
        """``aotc push`` the store's entries to ``url`` in a fresh process (what a build machine
        runs after compiling)."""
        t = time.perf_counter()
        env = dict(self.base_env, AOTC_SIGNING_KEY=str(self._signer()[0]))  # a build machine signs
        out = subprocess.run([sys.executable, "-m", "aotc.cli", "--store", str(store), "push",
                              "--to", url, "--json", "-q"], env=env, capture_output=True,
                             text=True, cwd=ROOT, timeout=600, check=False)
        if out.returncode != 0:
            raise SystemExit(f"aotc push failed:\n{out.stderr[-4000:]}")
        res = json.loads(out.stdout)
        res = {"seconds": time.perf_counter() - t, "bytes": res["bytes_moved"],
               "blobs": sum(e["blobs_moved"] for e in res["entries"])}
        say(f"  push       {res['seconds']:7.2f}s  ({res['blobs']} blobs, {res['bytes']} B)")
        return res


@contextmanager
def remote_store(work: Path, env: dict[str, str]) -> Iterator[str]:
    """An S3-compatible server (moto's standalone server, tests/helpers/s3server.py) on loopback
    with one bucket; ``env`` is pointed at it. Yields ``s3://bucket``."""
    import boto3

    from tests.helpers.s3server import S3_ENV, s3_server

    with s3_server(str(work / "s3.log")) as endpoint:
        env.update(S3_ENV, AOTC_S3_ENDPOINT=endpoint)
        boto3.client("s3", endpoint_url=endpoint, **{k.lower(): env[k] for k in (
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}, region_name="us-east-1"
        ).create_bucket(Bucket="aotc-bench")
        yield "s3://aotc-bench"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median/min/max of time to first output and the medians of everything else."""
    ttfo = [r["ttfo"] for r in runs]
    phases = {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in runs[0]["phases"]}
    steady = {k: statistics.median(r["steady_ms"][k] for r in runs) for k in runs[0]["steady_ms"]}
    return {"runs": len(runs), "ttfo_median": statistics.median(ttfo), "ttfo_min": min(ttfo),
            "ttfo_max": max(ttfo), "phases": phases, "steady_ms": steady,
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
            "counters": runs[-1]["counters_end"],
            "counters_first_output": runs[-1]["counters_first_output"],
            "pulled_bytes": statistics.median(r.get("pulled_bytes", 0) for r in runs)}


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 size, 1 run, no scaling")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--sizes", type=int, choices=sorted(SIZE_SETS), default=None)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--steady", default="1,16,256", help="steady-state token counts")
    ap.add_argument("--steady-iters", type=int, default=None)
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--warm-machine", action="store_true",
                    help="every start keeps this machine's temp dir: Inductor's precompiled headers "
                         "and aotc's ISA probes as an earlier compile left them (a build machine's "
                         "second model), not fresh per cold start")
    ap.add_argument("--only", default=",".join(CONTENDERS),
                    help="comma-separated contenders to run (default: all)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    from bench.report import byte_compile_aotc

    byte_compile_aotc()  # as installed: aotc's bytecode written once, not per start
    layers = args.layers or (2 if args.quick else 8)
    n_sizes = args.sizes or (1 if args.quick else 5)
    runs = args.runs or (1 if args.quick else 3)
    steady_iters = args.steady_iters or (10 if args.quick else 30)
    scaling = not (args.quick or args.no_scaling)
    steady = [int(s) for s in args.steady.split(",") if s]
    t_start = time.perf_counter()
    only = tuple(c for c in args.only.split(",") if c)
    unknown = set(only) - set(CONTENDERS)
    if unknown:
        ap.error(f"--only: unknown contender(s) {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    with tempfile.TemporaryDirectory(prefix="aotc-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        main_manifest = write_manifest(work, layers, n_sizes, args.hidden)
        machine_tmp = Path(tempfile.gettempdir()) if args.warm_machine else None
        bench = Bench(main_manifest, work, runs, args.threads, steady, steady_iters, machine_tmp)
        if "aotc-remote" in only:
            bench.remote = stack.enter_context(remote_store(work, bench.base_env))
        say(f"== contenders: toy-llama {layers} layers, {n_sizes} compile sizes, {runs} run(s) ==")
        raw = bench.contenders(only)
        cold_compile: dict[str, float] = {f"{layers}L-{n_sizes}s": statistics.median(
            r["phases"]["aotc_compile"] for r in raw["aotc-cold"])}
        if n_sizes and "aotc-cold" in only:  # the dynamic artifact alone (the fixed part)
            say(f"== aotc cold compile, {layers} layers, dynamic only ==")
            b = Bench(write_manifest(work, layers, 0, args.hidden), work, runs, args.threads, [], 1,
                      machine_tmp)
            cold_compile[f"{layers}L-0s"] = statistics.median(  # as many runs as the main point
                r["phases"]["aotc_compile"] for r in b.contenders(("aotc-cold",))["aotc-cold"])
        if scaling:
            # depth at 1 compile size (what grows with depth is tracing, not the compiles: 1 size
            # shows it as well as 5 and keeps `make bench` under 20 min), sizes at 8 layers
            for lay, ns in [(2, 1), (32, 1), (8, 1), (8, 10)]:
                if (lay, ns) == (layers, n_sizes):
                    continue
                say(f"== scaling: aotc cold compile, {lay} layers, {ns} compile sizes ==")
                b = Bench(write_manifest(work, lay, ns, args.hidden), work, 1, args.threads, [], 1,
                          machine_tmp)
                r = b.contenders(("aotc-cold",))["aotc-cold"][0]
                cold_compile[f"{lay}L-{ns}s"] = r["phases"]["aotc_compile"]
    results = {
        "machine": machine(),
        "config": {"layers": layers, "compile_sizes": SIZE_SETS[n_sizes], "hidden": args.hidden,
                   "runs": runs, "threads": args.threads, "first_tokens": 7,
                   "steady_sizes": steady, "steady_iters": steady_iters, "quick": args.quick,
                   "warm_machine": args.warm_machine},
        "contenders": {k: summarize(v) for k, v in raw.items()},
        "raw": raw, "cold_compile_s": cold_compile, "steady_pair": bench.pair,
        "cold_compile_breakdown": raw["aotc-cold"][-1].get("compile_breakdown") if raw.get("aotc-cold") else None,
        "pushes": bench.pushes,
        "bench_seconds": time.perf_counter() - t_start,
    }
    results.update(ratios_and_targets(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "latest.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
