"""``python tests/helpers/clients_run.py CASE...``: in a fresh process, run each client case with
``backend="aotc"`` (settings from the environment) beside eager, and print one JSON line:
per case its figures (max logit error, tokens equal, aotc compiles it caused), then torch's and
aotc's counters. The clients are code aotc did not write: transformers' models and
``generate()``, a gpt-fast style decode loop, and Dynamo's own recompiles and graph breaks.

Cases: ``forward:ARCH`` (``torch.compile(model)`` called at 3 sizes: a static graph, then the
dynamic one Dynamo makes after the shape changes), ``generate:ARCH`` (``generate()`` with a
static cache, its decode step compiled through ``CompileConfig(backend="aotc")``, twice),
``gptfast``, ``static-shapes``, ``python-guard``, ``break-print``, ``break-item``, ``oov`` (a
token id outside the vocabulary between two valid calls);
ARCH in :data:`tests.fixtures.client_models.ARCHS`.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

from tests.fixtures import client_models as cm


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")


def forward(arch: str) -> dict[str, Any]:
    model = cm.hf_model(arch)
    compiled = torch.compile(model, backend="aotc")
    errs = {}
    with torch.no_grad():
        for n in (5, 9, 13):
            ids = torch.randint(0, cm.VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
            errs[str(n)] = _err(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    return {"max_err": max(errs.values()), "errors": errs}


def generate(arch: str) -> dict[str, Any]:
    from transformers import CompileConfig

    model = cm.hf_model(arch)
    ids = torch.randint(0, cm.VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    args = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, **args)
        config = CompileConfig(backend="aotc")
        config._compile_all_devices = True  # transformers compiles on accelerators only otherwise
        got = [model.generate(ids, compile_config=config, **args) for _ in range(2)]
    return {"tokens_equal": all(torch.equal(g, want) for g in got),
            "new_tokens": int(want.shape[1] - ids.shape[1]), "tokens": got[0][0].tolist()}


def gptfast() -> dict[str, Any]:
    tokens = {}
    for how in ("eager", "aotc"):
        model = cm.GptFastDecoder()
        step = model if how == "eager" else torch.compile(model, backend="aotc")
        tokens[how] = cm.decode(model, step, prompt=[3, 17, 5, 9], new=12)
    return {"tokens_equal": tokens["eager"] == tokens["aotc"], "tokens": tokens["aotc"]}


def static_shapes() -> dict[str, Any]:
    model = cm.small_mlp()
    compiled = torch.compile(model, backend="aotc", dynamic=False)
    with torch.no_grad():
        errs = [_err(compiled(x), model(x)) for x in (torch.randn(3, 16), torch.randn(5, 16),
                                                      torch.randn(3, 16))]
    return {"max_err": max(errs)}


def python_guard() -> dict[str, Any]:
    model = cm.Flagged()
    compiled = torch.compile(model, backend="aotc")
    x = torch.randn(4, 16)
    with torch.no_grad():
        errs = [_err(compiled(x, flag), model(x, flag)) for flag in (True, False, True)]
    return {"max_err": max(errs)}


def graph_break(kind: str) -> dict[str, Any]:
    model = cm.Breaking(kind)
    compiled = torch.compile(model, backend="aotc")
    x = torch.randn(4, 16)
    with torch.no_grad():
        errs = [_err(compiled(x), model(x)) for _ in range(2)]
    return {"max_err": max(errs)}


def out_of_vocabulary() -> dict[str, Any]:
    """A valid call, a token id outside the vocabulary, a valid call again (``dynamic=True``):
    the bad call must raise a ``RuntimeError`` naming the piece (never abort the process)."""
    model = cm.hf_model("llama")
    compiled = torch.compile(model, backend="aotc", dynamic=True)
    with torch.no_grad():
        first = _err(compiled(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits,
                     model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits)
        try:
            compiled(input_ids=torch.tensor([[1, 2, cm.VOCAB + 100, 3, 4]]))
            raised = None
        except RuntimeError as e:
            raised = f"{type(e).__name__}: {e}"
        ids = torch.tensor([[7, 8, 9, 10, 11, 12]])
        after = _err(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    return {"max_err": max(first, after), "raised": raised}


def run(case: str) -> dict[str, Any]:
    kind, _, arch = case.partition(":")
    if kind == "forward":
        return forward(arch)
    if kind == "generate":
        return generate(arch)
    if kind == "gptfast":
        return gptfast()
    if kind == "oov":
        return out_of_vocabulary()
    if kind == "static-shapes":
        return static_shapes()
    if kind == "python-guard":
        return python_guard()
    if kind in ("break-print", "break-item"):
        return graph_break(kind.removeprefix("break-"))
    raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.counters import COUNTERS

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    results = {}
    for case in sys.argv[1:]:
        torch._dynamo.reset()
        before, hits = COUNTERS.compiles, COUNTERS.cache_hits
        results[case] = {**run(case), "compiles": COUNTERS.compiles - before,
                         "hits": COUNTERS.cache_hits - hits}
    print(json.dumps({"cases": results, "counters": counters_snapshot()}))


if __name__ == "__main__":
    main()
