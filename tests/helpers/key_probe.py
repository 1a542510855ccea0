"""``python tests/helpers/key_probe.py STORE MANIFEST CHANGE [--build | --serve]``: the key-soundness probe.

In a fresh process, apply CHANGE (an in-process torch setting, or ``none``: the test changes the
environment, the cwd, the install) and look the same tiny model up in STORE through the three
front doors, without compiling: the manifest (``resolve``, as ``aotc run`` does), the backend
(the graph Dynamo hands ``torch.compile``, keyed by ``backend_key`` as the backend keys it) and a
precompiled entry (its probe, as ``aotc.precompiled`` finds it). Prints one JSON line: per front
door ``hit`` and the factor paths that differ from the stored entry, and where aotc was imported
from. With ``--build`` (the default settings' process) it compiles and stores all three; with
``--serve`` it warm-starts all three and runs them against eager (errors, counters).

Imports nothing from the checkout but aotc itself: it also runs under an installed wheel."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def apply(change: str) -> None:
    """An in-process change, made before anything is keyed (as a server's startup makes it)."""
    if change == "matmul-medium":
        torch.set_float32_matmul_precision("medium")
    elif change == "matmul-highest":  # the default's precision, said explicitly (vLLM's workers do)
        torch.set_float32_matmul_precision("highest")
    elif change == "matmul-high":
        torch.set_float32_matmul_precision("high")
    elif change == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif change == "cudnn-tf32-off":
        torch.backends.cudnn.allow_tf32 = False
    elif change == "fp16-reduction-off":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    elif change == "bf16-reduction-off":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    elif change == "deterministic":
        torch.use_deterministic_algorithms(True)
    elif change == "inductor-in-process":
        import torch._inductor.config as config

        config.epilogue_fusion = not config.epilogue_fusion
    elif change == "threads-1":
        torch.set_num_threads(1)
    elif change != "none" and change != "dtype-f64":
        raise SystemExit(f"unknown change {change!r}")


def model(change: str) -> torch.nn.Module:
    from aotc.models.toy_llama import build

    torch.manual_seed(0)
    m = build(layers=1, hidden=32, heads=2, vocab=64).eval()
    return m.to(torch.float64) if change == "dtype-f64" else m


def inputs(n: int = 7, mark: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions for ``n`` tokens, the token dim marked dynamic for a trace (a
    precompiled function is called with plain tensors: a marked one fails its guards)."""
    ids, pos = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)), torch.arange(n)
    if mark:
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
    return ids, pos


def build(store: Path, manifest: Path, change: str) -> dict[str, Any]:
    import aotc

    aotc.compile(manifest, store=store)
    m = model(change)
    with torch.no_grad():
        torch.compile(m, backend=aotc.backend(store=str(store)))(*inputs())
        torch._dynamo.reset()
        aotc.precompile(model(change), [inputs(5)], store=str(store))
    return {"built": True}


def serve(store: Path, manifest: Path) -> dict[str, Any]:
    """Warm starts through the three front doors, run against eager: nothing may compile."""
    import aotc
    from aotc._torch.inductor_facts import counters_snapshot

    out: dict[str, Any] = {}
    eager = model("none")
    ids, pos = inputs(9)
    with torch.no_grad():
        want = eager(ids, pos)
        runner = aotc.load(manifest, store=str(store))
        out["manifest_err"] = float((runner(input_ids=ids, positions=pos) - want).abs().max())
        be = aotc.backend(store=str(store))
        out["backend_err"] = float((torch.compile(model("none"), backend=be)(ids, pos) - want).abs().max())
        out["backend_hit"] = bool(be.last.get("hit"))
        torch._dynamo.reset()
        p = aotc.precompiled(model("none"), store=str(store), precompile_missing=False)
        out["precompiled_err"] = float((p(*inputs(5, False)) - eager(*inputs(5, False))).abs().max())
        out["precompiled_served"], out["precompiled_traced"] = p.served, p.traced
    out["counters"] = counters_snapshot()
    return out


def backend_lookup(store: Any, change: str) -> dict[str, Any]:
    from aotc.backend.config import BackendConfig, call_config
    from aotc.backend.graphkey import graph_device, static_graph
    from aotc.backend.serve import backend_key
    from aotc.records.key import explain
    from aotc.settings import Settings

    keyed: list[tuple[str, dict[str, Any]]] = []

    def keyer(gm: Any, ex: Any, **_: Any) -> Any:
        cfg = call_config(BackendConfig(), {}).with_env(os.environ).on_device(graph_device(ex), static_graph(gm))
        keyed.append(backend_key(gm, ex, cfg, store, Settings.from_env()))
        return gm.forward

    with torch.no_grad():
        torch.compile(model(change), backend=keyer)(*inputs())
    key, factors = keyed[0]
    hit = store.has(key)
    diffs: list[str] = []
    if not hit:
        stored = [e for e in map(store.get, store.keys()) if "backend" in e.factors
                  and "graph" in e.factors and e.factors["backend"]["splitting_ops"]]
        if stored:
            diffs = [d.path for d in explain(stored[0].factors, factors)]
    return {"hit": hit, "diffs": diffs, "key": key}


def main() -> None:
    store_path, manifest, change = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    apply(change)
    if "--build" in sys.argv:
        print(json.dumps(build(store_path, manifest, change)))
        return
    if "--serve" in sys.argv:
        import aotc

        print(json.dumps({"aotc_file": aotc.__file__, **serve(store_path, manifest)}))
        return
    import aotc
    from aotc.cache import Store
    from aotc.dynamo_artifacts.key import device_of, probe_for, target_id
    from aotc.lookup.resolve import resolve, resolve_probe
    from aotc.lookup.toolchain import machine_factors
    from aotc.manifest import load_manifest

    store = Store(store_path, create=False)
    memo = store.base / "toolchain"
    out: dict[str, Any] = {"aotc_file": aotc.__file__}
    m = load_manifest(manifest)
    if change == "dtype-f64":
        from dataclasses import replace

        m = replace(m, dtype="float16")  # a manifest field (float64 is not one it allows)
    res = resolve(m, store, machine_factors(m.device, memo), record=False)
    out["manifest"] = {"hit": res.entry is not None, "diffs": [d.path for d in res.diffs]}
    out["backend"] = backend_lookup(store, change)
    target = model(change)
    identity, _module = target_id(target)
    dev = device_of(target)
    found = resolve_probe(probe_for(identity, identity, machine_factors(dev, memo), None, {}, dev), store,
                          record=False)
    out["precompiled"] = {"hit": found.entry is not None, "diffs": [d.path for d in found.diffs]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
