"""``python tests/helpers/clients_more_run.py CASE...``: in a fresh process, run each case of the
second client corpus with ``torch.compile(..., backend="aotc")`` beside eager and print one JSON
line: per case its figures (errors against eager and the tolerance, tokens equal, aotc compiles
and store hits it caused, seconds) or the exception it raised (``error``: type and first line,
``detail``: the message's tail, ``traceback``), then torch's and aotc's counters. A case that
raises does not stop the others.

``CLIENTS_MORE_BACKEND=inductor`` runs the same cases through Inductor's own backend (to tell
aotc's failures from the library's or torch's, and to calibrate tolerances); ``eager`` through
Dynamo alone; ``none`` without ``torch.compile`` (``bench/clients.py``); ``precompiled`` through
``aotc.precompiled`` (Dynamo's output stored at the first call of a cold process, loaded with no
trace in a warm one).

Cases: ``cnn-maxpool``, ``encoder-two-shapes`` (sentence-transformers over a local tiny BERT at
two batch shapes), ``bf16-model``, ``fp16-model``, ``autocast-bf16``, ``cond``,
``torchao-int8``, ``torchao-int4``, ``peft-lora``, ``train-step``, ``threads``,
``pipeline-textgen``, ``diffusers-unet``, ``layout``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.fixtures import more_client_models as mm  # noqa: E402

BACKEND = os.environ.get("CLIENTS_MORE_BACKEND", "aotc")
# error / max(1, |eager|max): absolute below 1, relative above
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def compile_(fn: Any, **kw: Any) -> Any:
    if BACKEND == "none":  # plain eager, no torch.compile (bench/clients.py's baseline)
        return fn
    if BACKEND == "precompiled":  # the first call of a cold process precompiles with its arguments
        import aotc

        return aotc.precompiled(fn, **kw)
    return torch.compile(fn, backend=BACKEND, **kw)


def err(got: Any, want: torch.Tensor) -> float:
    """Largest difference over max(1, largest |want|); inf when the shapes or dtypes differ."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    scale = max(1.0, float(want.float().abs().max()))
    return float((got.float() - want.float()).abs().max()) / scale


def result(errors: dict[str, float], dtype: torch.dtype = torch.float32, tol: float | None = None,
           **extra: Any) -> dict[str, Any]:
    return {"max_err": max(errors.values()), "tol": TOL[dtype] if tol is None else tol,
            "errors": errors, **extra}


def cnn_maxpool() -> dict[str, Any]:
    model = mm.SmallCNN().eval()
    compiled = compile_(model)
    errs = {}
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(i))
            errs[f"call{i}"] = err(compiled(x), model(x))
    return result(errs)


def encoder_two_shapes() -> dict[str, Any]:
    """sentence-transformers over a tiny BERT saved locally; ``model.compile(backend=…)`` (its
    documented way), ``encode()`` at batch 2 x 8 tokens, then 3 x 5 (a recompile, dynamic)."""
    from sentence_transformers import SentenceTransformer

    batches = [["the cat sees a small dog", "a big bird eats the fish"],       # 6 words + CLS/SEP
               ["red sun runs", "the blue moon", "old stone house"]]          # 3 words + CLS/SEP
    with tempfile.TemporaryDirectory() as d:
        mm.tiny_bert_dir(Path(d))
        st = SentenceTransformer(d, device="cpu")
    st.eval()
    tok = st.tokenizer
    shapes = [list(tok(b, padding=True, return_tensors="pt")["input_ids"].shape) for b in batches]
    want = [st.encode(b, batch_size=len(b), convert_to_tensor=True) for b in batches]
    if BACKEND != "none":
        st.compile(backend=BACKEND)
    errs = {}
    for _ in range(2):
        for b, w, s in zip(batches, want, shapes):
            errs[f"{s[0]}x{s[1]}"] = max(errs.get(f"{s[0]}x{s[1]}", 0.0),
                                         err(st.encode(b, batch_size=len(b), convert_to_tensor=True), w))
    return result(errs, shapes=shapes)


def blocks(dtype: torch.dtype, autocast: bool = False) -> dict[str, Any]:
    """4 pre-norm blocks, width 128, cast to ``dtype`` (bf16 against eager: ~1e-2), or fp32
    under ``torch.autocast("cpu", dtype)``. Under autocast the matmuls are the same bf16 kernels
    compiled or not and the output is fp32 (the last LayerNorm): compiled equals eager to ~1e-7,
    while the model run without autocast differs by ~2.5e-3 (``without_autocast``), so the
    tolerance is 5e-4: a program that lost the autocast state fails."""
    model = mm.BlockStack(layers=4, dim=128, heads=4).eval()
    if not autocast:
        model = model.to(dtype)
    compiled = compile_(model)
    errs, plain = {}, {}
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(i))
            if autocast:
                with torch.autocast("cpu", dtype=dtype):
                    got, want = compiled(x), model(x)
                plain[f"call{i}"] = err(model(x), want)
            else:
                x = x.to(dtype)
                got, want = compiled(x), model(x)
            errs[f"call{i}"] = err(got, want)
    if autocast:
        return result(errs, tol=5e-4, out_dtype=str(want.dtype), without_autocast=plain)
    return result(errs, dtype, out_dtype=str(want.dtype))


def cond() -> dict[str, Any]:
    model = mm.WithCond().eval()
    compiled = compile_(model)
    errs = {}
    with torch.no_grad():
        for i, sign in enumerate((1, -1, 1, -1)):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)).abs() * sign
            errs[f"call{i}:{'true' if sign > 0 else 'false'}"] = err(compiled(x), model(x))
    return result(errs)


def torchao(bits: int) -> dict[str, Any]:
    """A tiny Llama quantized with torchao weight-only int8 (or int4), compiled, against the
    same quantized model run eagerly (torchao's defaults: ``quantize_`` also sets its
    recommended Inductor config, as it does for users).

    int4: torchao 0.18's ``Int4WeightOnlyConfig`` has no CPU path (its "plain" format needs the
    CUDA-only mslk kernels, "tile_packed_to_4d" needs CUDA, "plain_int32" XPU/NPU), so the CPU
    int4 weight-only is ``IntxWeightOnlyConfig(weight_dtype=torch.int4)``: int4 values in an
    int8 tensor (``IntxUnpackedToInt8Tensor``), dequantized in the graph."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    model = mm.tiny_llama()
    if bits == 8:
        quantize_(model, Int8WeightOnlyConfig())
    else:
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    kind = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    compiled = compile_(model)
    errs = {}
    with torch.no_grad():
        for i in range(2):  # one shape: the recompiles are the encoder's and the pipeline's
            ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(i))
            errs[f"call{i}"] = err(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    return result(errs, weight_type=kind)


def peft_lora() -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    base = mm.tiny_llama()
    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so the adapter changes the output
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).eval()
    compiled = compile_(model)
    errs = {}
    with torch.no_grad():
        for i in range(2):
            ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(i))
            errs[f"call{i}"] = err(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    return result(errs)


def train_step() -> dict[str, Any]:
    """Three SGD (momentum) steps through the compiled model in train mode (dropout off: p=0;
    BatchNorm1d's running stats move), against the same steps eagerly from the same init."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    eager, mine = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    compiled = compile_(mine)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, mine)]
    errs: dict[str, float] = {}
    missing: list[str] = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        losses = []
        for fn, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            loss = F.mse_loss(fn(x), y)
            loss.backward()
            losses.append(loss.detach())
        errs[f"loss{step}"] = err(losses[1], losses[0])
        for (name, pe), (_, pm) in zip(eager.named_parameters(), mine.named_parameters()):
            if pm.grad is None:
                missing.append(f"step{step}:{name}")
            else:
                errs[f"grad{step}:{name}"] = err(pm.grad, pe.grad)
        for opt in opts:
            opt.step()
    for (name, pe), (_, pm) in zip(eager.state_dict().items(), mine.state_dict().items()):
        errs[f"final:{name}"] = err(pm, pe) if pe.is_floating_point() else float(not torch.equal(pm, pe))
    return result(errs, missing_grads=missing)


def threads() -> dict[str, Any]:
    """4 threads x 20 calls on one compiled model, no call before the threads start; every
    result against eager's."""
    model = mm.mlp().eval()
    compiled = compile_(model)
    inputs = [[torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * t + i)) for i in range(20)]
              for t in range(4)]
    with torch.no_grad():
        want = [[model(x) for x in xs] for xs in inputs]
    got: list[list[Any]] = [[None] * 20 for _ in range(4)]
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def work(t: int) -> None:
        try:
            barrier.wait()
            with torch.no_grad():
                for i, x in enumerate(inputs[t]):
                    got[t][i] = compiled(x)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError(errors[0] + (f" (+{len(errors) - 1} more threads)" if len(errors) > 1 else ""))
    errs = {f"thread{t}": max(err(got[t][i], want[t][i]) for i in range(20)) for t in range(4)}
    return result(errs, calls=sum(g is not None for row in got for g in row))


def pipeline_textgen() -> dict[str, Any]:
    """transformers' ``pipeline("text-generation")`` over a tiny random GPT-2 and a word-level
    tokenizer made offline; the model's forward compiled; greedy tokens against eager's."""
    from transformers import pipeline

    model, tok = mm.tiny_gpt2(), mm.word_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    prompts = ["the cat sees a"]
    args = dict(max_new_tokens=5, do_sample=False, return_tensors=True, pad_token_id=0)
    want = [pipe(p, **args)[0]["generated_token_ids"] for p in prompts]
    pipe.model.forward = compile_(pipe.model.forward)
    got = [[pipe(p, **args)[0]["generated_token_ids"] for p in prompts] for _ in range(2)]
    got0 = [list(map(int, g)) for g in got[0]]
    return {"tokens_equal": all([list(map(int, g)) for g in run] == [list(map(int, w)) for w in want]
                                for run in got),
            "tokens": got0, "eager_tokens": [list(map(int, w)) for w in want]}


def diffusers_unet() -> dict[str, Any]:
    unet = mm.tiny_unet()
    compiled = compile_(unet)
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 4, 32, generator=g)
    errs = {}
    with torch.no_grad():
        for t in (10, 500):
            ts = torch.tensor([t])
            errs[f"t{t}"] = err(compiled(sample, ts, encoder_hidden_states=text).sample,
                                unet(sample, ts, encoder_hidden_states=text).sample)
    return result(errs)


def layout() -> dict[str, Any]:
    """Compiled for a contiguous (n, 16) input, dim 0 marked dynamic; then called with views of
    other strides: transposed, a column slice, a row slice, an expanded row, and another n."""
    model = mm.mlp().eval()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x) + x[:, :8].sum(dim=0, keepdim=True)

    compiled = compile_(fn)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g)
    torch._dynamo.mark_dynamic(x, 0)
    views = {
        "contiguous(6,16)": x,
        "transposed(6,16)": torch.randn(16, 6, generator=g).t(),
        "col-slice(6,16)": torch.randn(6, 32, generator=g)[:, ::2],
        "row-slice(6,16)": torch.randn(12, 16, generator=g)[::2],
        "expanded(6,16)": torch.randn(1, 16, generator=g).expand(6, 16),
        "transposed(9,16)": torch.randn(16, 9, generator=g).t(),
        "offset(5,16)": torch.randn(7, 16, generator=g)[2:],
        "contiguous(7,16)": torch.randn(7, 16, generator=g),
    }
    errs, strides, failed = {}, {}, {}
    with torch.no_grad():
        for name, v in views.items():  # every view tried: the error names each one that failed
            strides[name] = list(v.stride())
            try:
                errs[name] = err(compiled(v), fn(v))
            except Exception as e:  # noqa: BLE001 - reported below
                failed[name] = _summary(e)
    if failed:
        raise RuntimeError("; ".join(f"{name} strides {strides[name]}: {why}" for name, why in failed.items()))
    return result(errs, strides=strides)


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "cnn-maxpool": cnn_maxpool,
    "encoder-two-shapes": encoder_two_shapes,
    "bf16-model": lambda: blocks(torch.bfloat16),
    "fp16-model": lambda: blocks(torch.float16),
    "autocast-bf16": lambda: blocks(torch.bfloat16, autocast=True),
    "cond": cond,
    "torchao-int8": lambda: torchao(8),
    "torchao-int4": lambda: torchao(4),
    "peft-lora": peft_lora,
    "train-step": train_step,
    "threads": threads,
    "pipeline-textgen": pipeline_textgen,
    "diffusers-unet": diffusers_unet,
    "layout": layout,
}


def _summary(e: BaseException) -> str:
    """``Type: first line`` of the exception; for Dynamo's ``BackendCompilerFailed``, the
    backend's own error's (``BackendCompilerFailed: BackendError: graph input …``)."""
    inner = getattr(e, "inner_exception", None)
    if inner is not None:
        return f"{type(e).__name__}: {_summary(inner)}"
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:1500]


def main() -> None:
    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.counters import COUNTERS
    import torch._inductor.config  # noqa: F401 - Dynamo imports it anyway; saved around each case

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    for case in sys.argv[1:]:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}")
        torch._dynamo.reset()
        inductor_config = torch._inductor.config.get_config_copy()  # torchao's quantize_ patches it
        before, hits = COUNTERS.compiles, COUNTERS.cache_hits
        loads, fast = COUNTERS.loads, COUNTERS.fast_loads
        ind_before = counters_snapshot()["inductor_compiles"]
        start = time.perf_counter()
        try:
            got = CASES[case]()
        except Exception as e:  # noqa: BLE001 - one case's failure must not hide the others
            got = {"error": _summary(e), "detail": str(e)[-3000:],
                   "traceback": traceback.format_exc()[-6000:]}
        finally:
            torch._inductor.config.load_config(inductor_config)
        results[case] = {**got, "compiles": COUNTERS.compiles - before,
                         "hits": COUNTERS.cache_hits - hits,
                         "loads": COUNTERS.loads - loads, "fast_loads": COUNTERS.fast_loads - fast,
                         "inductor_compiles": counters_snapshot()["inductor_compiles"] - ind_before,
                         "seconds": round(time.perf_counter() - start, 2)}
        print(f"clients_more: {case}: {results[case].get('error') or 'ok'} "
              f"({results[case]['seconds']}s)", file=sys.stderr, flush=True)
    print(json.dumps({"backend": BACKEND, "cases": results, "counters": counters_snapshot()}))


if __name__ == "__main__":
    main()
