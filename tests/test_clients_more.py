"""More clients of the backend (``tests/helpers/clients_more_run.py``): a CNN with BatchNorm and
max pooling, sentence-transformers over a local tiny BERT at two batch shapes (a dynamic
recompile), bf16 / fp16 models and a model under bf16 autocast, ``torch.cond``, a Llama quantized
by torchao (int8 and int4 weight-only: tensor-subclass weights), a peft LoRA model, a training
step (backward and an optimizer step), 4 threads on one compiled model, transformers'
text-generation ``pipeline``, a diffusers UNet, and inputs whose strides differ from the ones a
dynamic graph was compiled for.

Every case runs cold (empty store) in one fresh process, then warm in another with an empty
Inductor dir, both with ``AOTC_FALLBACK=error`` (a graph aotc cannot serve raises instead of
going to Inductor). Per case: the results equal eager's within the dtype's tolerance, and warm
the case compiled nothing (neither aotc nor Inductor) and hit the store. A case that raises is
recorded by the helper with its error, so one failing case hides no other."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PYTHON, ROOT, python_env

HELPER = ROOT / "tests" / "helpers" / "clients_more_run.py"
CASES = ["cnn-maxpool", "encoder-two-shapes", "bf16-model", "fp16-model", "autocast-bf16", "cond",
         "torchao-int8", "torchao-int4", "peft-lora", "train-step", "threads", "pipeline-textgen",
         "diffusers-unet", "layout"]


def _run(cases: list[str], env: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    res = subprocess.run([PYTHON, str(HELPER), *cases], capture_output=True, text=True, env=env,
                         timeout=1200)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-4000:]}"
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "stderr": res.stderr,
            "wall_s": round(time.perf_counter() - start, 1)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Any]:
    """Every case cold (empty store, its own Inductor dir), then warm in a fresh process with a
    fresh empty Inductor dir."""
    tmp = tmp_path_factory.mktemp("clients-more")
    env = {**python_env(), "AOTC_STORE": str(tmp / "store"), "AOTC_FALLBACK": "error",
           "AOTC_LOG": "info", "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-cold")}
    env.pop("CLIENTS_MORE_BACKEND", None)
    cold = _run(CASES, env)
    warm_dir = tmp / "inductor-warm"
    warm = _run(CASES, {**env, "TORCHINDUCTOR_CACHE_DIR": str(warm_dir)})
    print(f"\nclients_more: cold {cold['wall_s']}s, warm {warm['wall_s']}s", file=sys.stderr)
    return {"cold": cold, "warm": warm, "warm_dir": warm_dir}


def _check_case(case: str, run: str, got: dict[str, Any]) -> None:
    assert "error" not in got, f"{case} ({run}): {got['error']}\n{got.get('traceback', '')}"
    if "max_err" in got:
        assert got["max_err"] <= got["tol"], (case, run, got)
    if "tokens_equal" in got:
        assert got["tokens_equal"], (case, run, got)
    if case == "train-step":
        assert got["missing_grads"] == [], (run, got["missing_grads"])
    if case == "threads":
        assert got["calls"] == 80, (run, got)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_cold_a_client_gets_eagers_results(corpus: dict[str, Any], case: str) -> None:
    got = corpus["cold"]["cases"][case]
    _check_case(case, "cold", got)
    assert got["compiles"] >= 1, got  # served by aotc: compiled (and stored) here


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_warm_a_client_gets_eagers_results_and_compiles_nothing(corpus: dict[str, Any],
                                                                  case: str) -> None:
    got = corpus["warm"]["cases"][case]
    _check_case(case, "warm", got)
    assert got["compiles"] == 0 and got["inductor_compiles"] == 0 and got["hits"] >= 1, got
    if "tokens" in got:
        assert got["tokens"] == corpus["cold"]["cases"][case]["tokens"]
    if case.startswith("torchao") or case == "train-step":  # subclass weights flattened; a
        assert got["fast_loads"] == got["loads"] > 0, got   # training piece's fw+bw: no Inductor


@pytest.mark.slow
def test_the_warm_process_compiles_nothing_and_writes_no_kernels(corpus: dict[str, Any]) -> None:
    c = corpus["warm"]["counters"]
    assert c["compiles"] == 0 and c["inductor_compiles"] == 0, c
    assert " miss" not in corpus["warm"]["stderr"], corpus["warm"]["stderr"][-3000:]
    kernels = [p for p in Path(corpus["warm_dir"]).rglob("*") if p.suffix in (".so", ".cpp")]
    assert kernels == [], kernels[:5]
