"""The backend under torch.compile clients aotc did not write (``tests/helpers/clients_run.py``):
transformers' models at 3 sizes and ``generate()`` with a static cache over six architectures, a
gpt-fast style decode loop, Dynamo's recompiles (automatic dynamic shapes, ``dynamic=False``
with two shapes, a guard on a Python value) and graph breaks (``print``, ``.item()``), and a
token id outside the vocabulary. Each runs cold in one fresh process and warm in another (an
empty Inductor dir): results equal eager, nothing compiled warm. ``AOTC_FALLBACK=error``: a
graph aotc cannot serve fails the test instead of being served by Inductor.

Before this suite, ``generate()`` aborted the process: the backend's compile-time fast-path
check ran the decode graph on the live cache's ``cumulative_length`` and advanced it, so
decoding later wrote past the static cache and a kernel's bounds check (thrown inside an
OpenMP region) called ``std::terminate``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PYTHON, ROOT, python_env
from tests.fixtures.client_models import ARCHS

HELPER = ROOT / "tests" / "helpers" / "clients_run.py"
CASES = [*(f"forward:{a}" for a in ARCHS), *(f"generate:{a}" for a in ARCHS), "gptfast",
         "static-shapes", "python-guard", "break-print", "break-item", "oov"]


def _run(cases: list[str], env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([PYTHON, str(HELPER), *cases], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-4000:]}"
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "stderr": res.stderr}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Any]:
    """Every case cold (empty store), then warm in a fresh process with an empty Inductor dir,
    then the out-of-vocabulary case warm through Inductor's own loader."""
    tmp = tmp_path_factory.mktemp("clients")
    env = {**python_env(), "AOTC_STORE": str(tmp / "store"), "AOTC_FALLBACK": "error", "AOTC_LOG": "info",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-cold")}
    cold = _run(CASES, env)
    warm_dir = tmp / "inductor-warm"
    warm = _run(CASES, {**env, "TORCHINDUCTOR_CACHE_DIR": str(warm_dir)})
    loader = _run(["oov", "generate:llama"], {**env, "AOTC_LOADER": "inductor",
                                              "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-3")})
    return {"cold": cold, "warm": warm, "warm_dir": warm_dir, "inductor_loader": loader}


def _check_case(case: str, got: dict[str, Any]) -> None:
    if "tokens_equal" in got:
        assert got["tokens_equal"], (case, got)
    if "max_err" in got:
        assert got["max_err"] < 1e-3, (case, got)
    if case.startswith("generate:"):
        assert got["new_tokens"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_client_gets_eagers_results_cold_and_warm(corpus: dict[str, Any], case: str) -> None:
    cold, warm = corpus["cold"]["cases"][case], corpus["warm"]["cases"][case]
    _check_case(case, cold)
    _check_case(case, warm)
    assert warm["compiles"] == 0 and warm["hits"] >= 1, warm
    if "tokens" in cold:
        assert cold["tokens"] == warm["tokens"]


@pytest.mark.slow
def test_the_warm_process_compiles_nothing_and_writes_no_kernels(corpus: dict[str, Any]) -> None:
    c = corpus["warm"]["counters"]
    assert c["compiles"] == 0 and c["inductor_compiles"] == 0, c
    assert c["fast_loads"] == c["loads"] > 0, c
    assert " miss" not in corpus["warm"]["stderr"] and "not served by aotc" not in corpus["warm"]["stderr"]
    assert "hit: loaded from the store" in corpus["warm"]["stderr"]  # the INFO lines are on (AOTC_LOG)
    kernels = [p for p in Path(corpus["warm_dir"]).rglob("*") if p.suffix in (".so", ".cpp")]
    assert kernels == [], kernels[:5]


@pytest.mark.slow
def test_graphs_of_one_model_are_keyed_and_stored_apart(corpus: dict[str, Any]) -> None:
    """Recompiles and graph breaks: two graphs each, both stored, both hit warm."""
    for case in ("forward:llama", "static-shapes", "python-guard", "break-print", "break-item"):
        assert corpus["warm"]["cases"][case]["hits"] >= 2, (case, corpus["warm"]["cases"][case])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["cold", "warm", "inductor_loader"])
def test_an_index_out_of_range_raises_and_the_next_call_works(corpus: dict[str, Any], run: str) -> None:
    """A kernel's bounds check (inside an OpenMP region where Inductor parallelizes the kernel:
    test_backend_safety covers one that always is) reaches the caller as a ``RuntimeError``
    naming the piece and size — fast path, or Inductor's loader — and the process lives on."""
    got = corpus[run]["cases"]["oov"]
    assert got["raised"] and "index out of bounds" in got["raised"], got
    assert got["raised"].startswith("RunError: piece submod_0") and "dynamic" in got["raised"], got
    assert got["max_err"] < 1e-3
    if run == "inductor_loader":
        assert corpus[run]["cases"]["generate:llama"]["tokens_equal"]
        assert corpus[run]["counters"]["compiles"] == 0
