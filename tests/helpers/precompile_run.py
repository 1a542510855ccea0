"""``python tests/helpers/precompile_run.py [--build] CASE...``: in a fresh process, run each case
through ``aotc.precompiled`` beside eager — with ``--build`` (the cold process) ``aotc.precompile``
first — and print one JSON line: per case its figures (errors, tokens equal, calls served by
stored code and by the traced path, Dynamo frames and graphs and Inductor compiles it caused),
then torch's and aotc's counters.

Cases: ``forward`` (an HF Llama precompiled at two example shapes, called at both and at a third,
which misses the guards), ``gptfast`` (a gpt-fast style decode loop, the step precompiled),
``generate:ARCH`` (``generate()`` with a static cache through ``serve_generate``, twice),
``constant`` (a module constant changed after loading: the guard on it fails, the traced path
runs). Settings from the environment (``AOTC_STORE``, trust, signing)."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

import aotc
from tests.fixtures import client_models as cm
from tests.fixtures import precompile_models as pm

BUILD = "--build" in sys.argv


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")


def _counts(p: Any) -> dict[str, Any]:
    return {"served": p.served, "traced": p.traced, "functions": len(p.functions), "key": p.key}


def forward() -> dict[str, Any]:
    model = cm.hf_model("llama")
    shapes = [(2, 7), (2, 9)]
    ids = [torch.randint(0, cm.VOCAB, s, generator=torch.Generator().manual_seed(s[1])) for s in shapes]
    with torch.no_grad():
        p = aotc.precompile(model, [{"input_ids": i} for i in ids]) if BUILD \
            else aotc.precompiled(model, precompile_missing=False)
        errs = [_err(p(input_ids=i).logits, model(input_ids=i).logits) for i in ids]
        stored = _counts(p)
        other = torch.randint(0, cm.VOCAB, (1, 5), generator=torch.Generator().manual_seed(5))
        miss_err = _err(p(input_ids=other).logits, model(input_ids=other).logits)
    return {"max_err": max(errs), "miss_err": miss_err, "stored": stored, **_counts(p), "miss": p.last_miss}


def gptfast() -> dict[str, Any]:
    tokens = {}
    eager = cm.GptFastDecoder()
    tokens["eager"] = cm.decode(eager, eager, prompt=[3, 17, 5, 9], new=12)
    model = cm.GptFastDecoder()
    with torch.no_grad():
        if BUILD:  # on another instance: the example input's step must not move the live model's state
            aotc.precompile(cm.GptFastDecoder(), [(torch.tensor([[1]]), torch.tensor([4]))])
        p = aotc.precompiled(model, precompile_missing=False)
    tokens["aotc"] = cm.decode(model, p, prompt=[3, 17, 5, 9], new=12)
    return {"tokens_equal": tokens["eager"] == tokens["aotc"], "tokens": tokens["aotc"],
            "steps": int(model.steps), **_counts(p)}


def generate(arch: str) -> dict[str, Any]:
    from aotc.dynamo_artifacts.hf import serve_generate

    model = cm.hf_model(arch)
    ids = torch.randint(0, cm.VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0,
                cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, **args)
        step = serve_generate(model, precompile_missing=BUILD)
        got = [model.generate(ids, **args) for _ in range(2)]
    return {"tokens_equal": all(torch.equal(g, want) for g in got), "tokens": got[0][0].tolist(), **_counts(step)}


def constant() -> dict[str, Any]:
    model = pm.Scaled()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p = aotc.precompile(model, [(x,)]) if BUILD else aotc.precompiled(model, precompile_missing=False)
        before = _err(p(x), model(x))
        pm.SCALE = 3.0
        try:
            after = _err(p(x), model(x))
        finally:
            pm.SCALE = 2.0
    return {"max_err": max(before, after), **_counts(p), "miss": p.last_miss}


def run(case: str) -> dict[str, Any]:
    kind, _, arch = case.partition(":")
    cases = {"forward": forward, "gptfast": gptfast, "constant": constant}
    if kind == "generate":
        return generate(arch)
    if kind in cases:
        return cases[kind]()
    raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.counters import COUNTERS

    warnings.filterwarnings("ignore")
    results = {}
    for case in [a for a in sys.argv[1:] if a != "--build"]:
        before = counters_snapshot()
        got = run(case)
        after = counters_snapshot()
        results[case] = {**got, "frames": after["frames_traced"] - before["frames_traced"],
                         "graphs": after["graphs_captured"] - before["graphs_captured"],
                         "inductor": after["inductor_compiles"] - before["inductor_compiles"],
                         "compile_imported": any(m.startswith("aotc.compile.") for m in sys.modules)}
    print(json.dumps({"cases": results, "counters": {**counters_snapshot(), **COUNTERS.snapshot()}}))


if __name__ == "__main__":
    main()
