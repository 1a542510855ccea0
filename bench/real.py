"""The serving node at a size people serve: a Qwen2-0.5B-shaped model, side by side, one run.

    python -m bench.real [--runs N] [--cold-runs N] [--out DIR]      (make bench-real, <= 15 min)

The model: transformers' ``Qwen2ForCausalLM`` with Qwen2-0.5B's shape (24 layers, hidden 896,
14/2 heads, MLP 4864, vocabulary 151,936, tied embeddings; 494 M parameters, float32), seeded
random weights written once with ``save_pretrained`` under ``$AOTC_BENCH_MODELS`` (default
``~/.cache/aotc-bench``) and reused. Every contender is a fresh process (spawned by this one, its
peak RSS — the largest of it and any process it started — read from ``wait4``):

- ``generate()`` greedy, batch 1, 16-token prompt, 16 new tokens, ``cache_implementation="static"``:
  eager; Inductor cold (empty Inductor cache dir and TMPDIR) and warm (the same dirs); aotc's
  backend cold (empty store, Inductor dir, TMPDIR) and warm (the store, a new empty Inductor dir);
  ``serve_generate`` (precompiled) cold and warm. Spawn → first new token, spawn → first
  ``generate()`` done, the first ``generate()``, a later one, Dynamo frames, Inductor compiles,
  tokens = eager's.
- the manifest door: ``aotc compile`` of a manifest for the model (the CLI, a fresh process), then
  ``aotc.load`` of it in another, one 16-token forward checked against eager's logits.
- paired in ONE process (alternating blocks; both see the same machine): decode ``generate()``
  Inductor warm vs aotc warm, and the dynamic-shape forward at 256 tokens
  (``torch.compile(model, backend=…, dynamic=True)``, no cache) — process-to-process figures
  here swing by more than the differences measured.

Between contenders nothing of the previous one may be alive: every child gets a marker in its
environment and the parent waits until no process carries it (a figure taken beside a leftover
compile is not a figure). ``--runs`` rounds of the warm and eager contenders, ``--cold-runs`` of
the cold ones; medians. Writes ``results/real.json`` and ``real.md``.
"""

from __future__ import annotations

import time

SPAWN_LINE_AT = time.time()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QWEN2_05B: dict[str, Any] = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
PROMPT, NEW_TOKENS, LATER_CALLS, LONG = 16, 16, 2, 256
MARK = "AOTC_BENCH_CHILD"


def model_dir(layers: int = 24) -> Path:
    """The model's directory, written once (seeded random weights) and reused."""
    import transformers

    cfg = dict(QWEN2_05B, num_hidden_layers=layers)
    tag = hashlib.sha256(json.dumps([cfg, transformers.__version__.split(".")[:2]],
                                    sort_keys=True).encode()).hexdigest()[:12]
    base = Path(os.environ.get("AOTC_BENCH_MODELS") or Path.home() / ".cache" / "aotc-bench")
    path = base / f"qwen2-0.5b-shaped-{layers}L-{tag}"
    if (path / "config.json").is_file():
        return path
    say(f"writing the model once to {path}")
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=base))  # renamed when complete
    # in a child: this process's peak RSS is a floor under every child's figure (wait4's
    # ru_maxrss keeps the peak of the memory a child was forked from)
    subprocess.run([sys.executable, "-m", "bench.real", "--child",
                    json.dumps({"mode": "write", "config": cfg, "path": str(tmp)})], cwd=ROOT, check=True)
    tmp.rename(path)
    return path


def child_write(cfg: dict[str, Any]) -> dict[str, Any]:
    """Write the model (seeded random weights) to ``cfg["path"]``, in this fresh process."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**cfg["config"])).save_pretrained(cfg["path"])
    return {"written": cfg["path"]}


def prompt_ids() -> Any:
    import torch

    return torch.randint(1, QWEN2_05B["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))


def child_generate(cfg: dict[str, Any]) -> dict[str, Any]:
    """One ``generate()`` contender (module doc) in this fresh process."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(int(cfg["threads"]))
    model = AutoModelForCausalLM.from_pretrained(cfg["model"]).eval()
    ids = prompt_ids()
    token_at: list[float] = []

    class FirstToken(BaseStreamer):  # put() gets the prompt first, then each new token
        def put(self, value: Any) -> None:
            token_at.append(time.time())

        def end(self) -> None:
            pass

    kwargs: dict[str, Any] = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                  cache_implementation="static", attention_mask=torch.ones_like(ids),
                                  pad_token_id=0)
    load_s = 0.0
    if cfg["backend"] == "precompiled":
        from aotc.dynamo_artifacts.hf import serve_generate

        t = time.perf_counter()
        serve_generate(model)
        load_s = time.perf_counter() - t
    elif cfg["backend"]:
        cc = CompileConfig(backend=cfg["backend"])
        cc._compile_all_devices = True  # transformers compiles only on accelerators otherwise
        kwargs["compile_config"] = cc
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, streamer=FirstToken(), **kwargs)
    first_done_at, first_s = time.time(), time.perf_counter() - t
    later = []
    for _ in range(LATER_CALLS):
        t = time.perf_counter()
        with torch.no_grad():
            again = model.generate(ids, **kwargs)
        later.append(time.perf_counter() - t)
        if not torch.equal(again, out):
            raise SystemExit("a later generate()'s tokens differ from the first's")
    from bench.child import _counters

    return {"first_s": first_s, "first_done_at": first_done_at, "first_token_at": token_at[1],
            "later_s": statistics.median(later), "load_s": load_s, "counters": _counters(),
            "tokens": out[0, PROMPT:].tolist()}


def child_load(cfg: dict[str, Any]) -> dict[str, Any]:
    """``aotc.load`` of the manifest, one forward, checked against eager's logits."""
    import torch

    import aotc
    from aotc.manifest import load_manifest
    from aotc.model.build import build_model

    torch.set_num_threads(int(cfg["threads"]))
    manifest = load_manifest(cfg["manifest"])
    model = build_model(manifest)
    t = time.perf_counter()
    runner = aotc.load(manifest, model=model)
    load_s = time.perf_counter() - t
    ids = prompt_ids()
    pos = torch.arange(PROMPT).unsqueeze(0)
    with torch.no_grad():
        got = runner(ids, pos)
        first_done_at = time.time()
        want = model(input_ids=ids, position_ids=pos).logits
    got = got[0] if isinstance(got, (tuple, list)) else got
    from bench.child import _counters

    return {"load_s": load_s, "first_done_at": first_done_at, "counters": _counters(),
            "max_abs_diff": float((got - want).abs().max()),
            "tokens_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}


def _toy() -> Any:
    """The tiny Llama of bench/hf_generate.py (4 layers, hidden 128), seeded: the 256-token
    forward at toy size, where Python overhead and fusion matter more than memory bandwidth."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=1024)).eval()


def child_pair(cfg: dict[str, Any]) -> dict[str, Any]:
    """Inductor warm vs aotc warm in ONE process, alternating blocks (the order flips each
    round): decode ``generate()``, and the dynamic forward at ``LONG`` tokens at real size and at
    toy size (``torch.compile(model, backend=…, dynamic=True)``, first called at 100 tokens so
    that 256 runs the dynamic artifact). Each backend on its own copy of the model."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    torch.set_num_threads(int(cfg["threads"]))
    ids = prompt_ids()
    long_ids = torch.randint(1, 1000, (1, LONG), generator=torch.Generator().manual_seed(2))
    calls: dict[str, dict[str, Any]] = {}
    toy = _toy()
    for backend in ("inductor", "aotc"):
        model = AutoModelForCausalLM.from_pretrained(cfg["model"]).eval()
        cc = CompileConfig(backend=backend)
        cc._compile_all_devices = True
        kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  cache_implementation="static", attention_mask=torch.ones_like(ids), pad_token_id=0,
                  compile_config=cc)
        fwd = torch.compile(model, backend=backend, dynamic=True)
        mine = _toy()
        mine.load_state_dict(toy.state_dict())
        fwd_toy = torch.compile(mine, backend=backend, dynamic=True)
        calls[backend] = {"decode": (lambda m=model, k=kw: m.generate(ids, **k)),
                          "forward": (lambda n=LONG, f=fwd: f(input_ids=long_ids[:, :n], use_cache=False).logits),
                          "forward-toy": (lambda n=LONG, f=fwd_toy: f(input_ids=long_ids[:, :n],
                                                                      use_cache=False).logits)}
    out: dict[str, Any] = {}
    plan = (("decode", int(cfg["decode_rounds"]), 2), ("forward", 6, 3), ("forward-toy", 16, 10))
    for what, rounds, block in plan:
        with torch.no_grad():
            if what != "decode":  # the first call traces at another size: 256 runs dynamic
                for b in calls:
                    calls[b][what](100)
            first = {b: calls[b][what]() for b in calls}
            for b in calls:
                calls[b][what]()
            ratio, times = [], {b: [] for b in calls}  # type: ignore[var-annotated]
            for r in range(rounds):
                med = {}
                for b in (("inductor", "aotc") if r % 2 == 0 else ("aotc", "inductor")):
                    block_t = []
                    for _ in range(block):
                        t = time.perf_counter()
                        calls[b][what]()
                        block_t.append(time.perf_counter() - t)
                    med[b] = statistics.median(block_t)
                    times[b] += block_t
                ratio.append(med["aotc"] / med["inductor"])
        a, i = first["aotc"], first["inductor"]
        out[what] = {"aotc_s": statistics.median(times["aotc"]),
                     "inductor_s": statistics.median(times["inductor"]),
                     "aotc_time_over_inductor": statistics.median(ratio),
                     "min": min(ratio), "max": max(ratio),
                     "equal": bool(torch.equal(a, i)) if what == "decode"
                     else bool(torch.allclose(a, i, atol=1e-3, rtol=1e-3))}
    return out


def run(argv: list[str], env: dict[str, str], tag: str) -> dict[str, Any]:
    """A fresh process; its last stdout line as JSON (or ``error``), ``peak_rss_gb`` of it and
    its descendants (``wait4``), ``spawned_at``; then waits until nothing it started is alive."""
    env = dict(env, **{MARK: tag})
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        spawned = time.time()
        p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - spawned
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    left = leftovers(tag, wait=120.0)
    res: dict[str, Any]
    if p.returncode != 0:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        res = {"error": f"exit {p.returncode}: " + "\n".join(lines[-8:])}
    else:
        lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {}
    res.update(peak_rss_gb=usage.ru_maxrss / 2**20, wall_s=wall, spawned_at=spawned, leftovers=left)
    for k in ("first_done_at", "first_token_at"):
        if k in res:
            res[k.replace("_at", "_from_spawn_s")] = res[k] - spawned
    return res


def leftovers(tag: str, wait: float) -> int:
    """Processes still alive carrying ``tag`` (after waiting up to ``wait`` s for them to end)."""
    deadline = time.time() + wait
    needle = f"{MARK}={tag}".encode()
    while True:
        alive = 0
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    alive += needle in (d / "environ").read_bytes().split(b"\0")
                except OSError:
                    pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    (path / "tmp").mkdir(parents=True)
    return path


def write_manifest(work: Path, model: Path) -> Path:
    cfg = ", ".join(f"{k}: {json.dumps(v)}" for k, v in QWEN2_05B.items())
    path = work / "qwen2-0.5b-shaped.yaml"
    path.write_text(f"""name: qwen2-0.5b-shaped
model:
  hf: {{architecture: Qwen2ForCausalLM, config: {{{cfg}}}}}
  weights: {model}
  output: logits
dtype: float32
device: cpu
inputs:
  - {{name: input_ids, dtype: int64, shape: [1, tokens], high: 1000}}
  - {{name: position_ids, dtype: int64, shape: [1, tokens], fill: arange}}
compile_sizes: [{PROMPT}]
splitting_ops: ["aten::scaled_dot_product_attention"]
""")
    return path


GENERATE = {"eager": None, "inductor-cold": "inductor", "inductor-warm": "inductor", "aotc-cold": "aotc",
            "aotc-warm": "aotc", "precompiled-cold": "precompiled", "precompiled-warm": "precompiled"}
COLD = ("inductor-cold", "aotc-cold", "precompiled-cold", "manifest-compile")


def bench(work: Path, runs: int, cold_runs: int, threads: int, decode_rounds: int) -> dict[str, Any]:
    """Every contender in rounds (the cold ones in the first ``cold_runs``), then the pair."""
    model = model_dir()
    manifest = write_manifest(work, model)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "AOTC_"))}
    base.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    me = [sys.executable, "-m", "bench.real", "--child"]
    raw: dict[str, list[dict[str, Any]]] = {}
    for i in range(max(runs, cold_runs)):
        say(f"round {i + 1}")
        if i < cold_runs:
            dirs = {n: fresh(work / n) for n in ("ind", "ind-a", "store", "pstore", "mstore", "ind-m")}
        for name in list(GENERATE) + ["manifest-compile", "manifest-load"]:
            if (name in COLD and i >= cold_runs) or (name not in COLD and i >= runs):
                continue
            ind = {"inductor-cold": dirs["ind"], "inductor-warm": dirs["ind"], "aotc-cold": dirs["ind-a"],
                   "manifest-compile": dirs["ind-m"]}.get(name) or fresh(work / "ind-fresh")
            store = {"precompiled-cold": "pstore", "precompiled-warm": "pstore",
                     "manifest-compile": "mstore", "manifest-load": "mstore"}.get(name, "store")
            env = dict(base, TORCHINDUCTOR_CACHE_DIR=str(ind), TRITON_CACHE_DIR=str(ind / "triton"),
                       TMPDIR=str(ind / "tmp"), AOTC_STORE=str(dirs[store]))
            if name == "manifest-compile":
                argv = [sys.executable, "-m", "aotc.cli", "compile", str(manifest)]
            else:
                cfg = {"mode": "load" if name == "manifest-load" else "generate", "model": str(model),
                       "manifest": str(manifest), "backend": GENERATE.get(name), "threads": threads}
                argv = me + [json.dumps(cfg)]
            res = run(argv, env, f"{name}-{i}")
            raw.setdefault(name, []).append(res)
            say(f"  {name:17s} " + (res["error"].splitlines()[-1][:200] if "error" in res else " ".join(
                f"{k} {res[k]:.2f}" for k in ("first_token_from_spawn_s", "first_done_from_spawn_s", "first_s",
                                               "later_s", "wall_s", "peak_rss_gb") if k in res)
                + f" {res.get('counters', '')}" + (f" LEFTOVERS {res['leftovers']}" if res["leftovers"] else "")))
    env = dict(base, TORCHINDUCTOR_CACHE_DIR=str(dirs["ind"]), TRITON_CACHE_DIR=str(dirs["ind"] / "triton"),
               TMPDIR=str(dirs["ind"] / "tmp"), AOTC_STORE=str(dirs["store"]))
    pair = run(me + [json.dumps({"mode": "pair", "model": str(model), "threads": threads,
                                 "decode_rounds": decode_rounds})], env, "pair")
    say(f"  pair {pair}")
    # a child's peak RSS (wait4) is at least this process's peak: kept to judge the RSS figures by
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"raw": raw, "pair": pair, "bench_peak_rss_gb": own}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="rounds of eager and the warm contenders")
    ap.add_argument("--cold-runs", type=int, default=3, help="rounds of the cold contenders")
    ap.add_argument("--decode-rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        cfg = json.loads(args.child)
        res = {"generate": child_generate, "load": child_load, "pair": child_pair,
               "write": child_write}[cfg["mode"]](cfg)
        print(json.dumps(res))
        return res
    from bench.real_report import markdown, summarize
    from bench.report import byte_compile_aotc, write_results

    byte_compile_aotc()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aotc-real-") as tmp:
        got = bench(Path(tmp), args.runs, args.cold_runs, args.threads, args.decode_rounds)
    res = summarize(got, args, time.perf_counter() - t0)
    write_results(args.out, "real", res, markdown(res))
    return res


if __name__ == "__main__":
    main()
