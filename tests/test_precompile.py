"""No Dynamo trace at a warm start (``aotc.precompile`` / ``aotc.precompiled``), in fresh processes
(``tests/helpers/precompile_run.py``): an HF model's forward at two example shapes, a gpt-fast
style decode loop, ``generate()`` with a static cache over six architectures
(``serve_generate``), and a module constant. A cold process precompiles (signing what it
stores); a warm one — an empty Inductor dir, the signer's key required, a C++ compiler on PATH
that logs each call — loads: results equal eager's, no Dynamo frame or graph, no Inductor
compile, no compiler call. A guard miss takes the traced path and is still right; a tampered
artifact is refused before a byte of it is unpickled."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PYTHON, ROOT, python_env
from tests.fixtures.client_models import ARCHS

HELPER = ROOT / "tests" / "helpers" / "precompile_run.py"
SERVED_ONLY = ["gptfast", *(f"generate:{a}" for a in ARCHS)]  # every call covered by the stored code
CASES = [*SERVED_ONLY, "forward", "constant"]  # the guard misses last: they import the compile journey


def _run(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([PYTHON, str(HELPER), *args], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-4000:]}"
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "stderr": res.stderr}


def _logging_compilers(bin_dir: Path, log: Path) -> None:
    """``g++``, ``gcc``, ``c++``, ``cc`` on PATH that append their arguments to ``log`` and run the
    real one (found now, before PATH changes)."""
    bin_dir.mkdir(parents=True)
    for name in ("g++", "gcc", "c++", "cc"):
        real = shutil.which(name)
        if real is None:
            continue
        wrapper = bin_dir / name
        wrapper.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        wrapper.chmod(0o755)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """Every case cold (``--build``, signing), then warm in a fresh process with an empty Inductor
    dir and the signer's key required; the compiler log's length after each."""
    from aotc.fleet.trust import generate_key

    tmp = tmp_path_factory.mktemp("precompile")
    public = generate_key(tmp / "signer")
    log = tmp / "compilers.log"
    _logging_compilers(tmp / "bin", log)
    env = {**python_env(), "AOTC_STORE": str(tmp / "store"), "AOTC_LOG": "info", "AOTC_FALLBACK": "error",
           "AOTC_SIGNING_KEY": str(tmp / "signer"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-cold"),
           "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    cold = _run(["--build", *CASES], env)
    calls_cold = log.read_text().count("\n") if log.exists() else 0
    shutil.copytree(tmp / "store", tmp / "to-tamper")
    warm_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-warm"), "AOTC_TRUST_KEYS": public}
    warm_env.pop("AOTC_SIGNING_KEY")
    warm = _run(CASES, warm_env)
    calls_warm = (log.read_text().count("\n") if log.exists() else 0) - calls_cold
    return {"cold": cold, "warm": warm, "calls_cold": calls_cold, "calls_warm": calls_warm, "tmp": tmp,
            "warm_env": warm_env}


def _check(case: str, got: dict[str, Any]) -> None:
    if "tokens_equal" in got:
        assert got["tokens_equal"], (case, got)
    if "max_err" in got:
        assert got["max_err"] < 1e-3, (case, got)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_warm_results_equal_eager_from_the_stored_code(runs: dict[str, Any], case: str) -> None:
    cold, warm = runs["cold"]["cases"][case], runs["warm"]["cases"][case]
    _check(case, cold)
    _check(case, warm)
    assert warm["key"] == cold["key"] and warm["functions"] == cold["functions"] >= 1, (cold, warm)
    assert warm["served"] >= 1 and warm["inductor"] == 0, warm
    if "tokens" in cold:
        assert cold["tokens"] == warm["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("case", SERVED_ONLY)
def test_a_warm_start_does_not_trace(runs: dict[str, Any], case: str) -> None:
    """Every call served by Dynamo's stored code: no frame traced, no graph captured, nothing of
    the compile journey imported."""
    warm = runs["warm"]["cases"][case]
    assert warm["traced"] == 0 and warm["frames"] == 0 and warm["graphs"] == 0, warm
    assert not warm["compile_imported"], warm


@pytest.mark.slow
def test_the_warm_process_compiles_nothing_and_calls_no_compiler(runs: dict[str, Any]) -> None:
    c = runs["warm"]["counters"]
    assert c["compiles"] == 0 and c["inductor_compiles"] == 0 and c["fast_loads"] == c["loads"] > 0, c
    assert runs["calls_cold"] > 0  # the logging compiler is the one Inductor runs
    assert runs["calls_warm"] == 0, runs["calls_warm"]
    kernels = [p for p in (runs["tmp"] / "inductor-warm").rglob("*") if p.suffix in (".so", ".cpp")]
    assert kernels == [], kernels[:5]
    assert "loaded 1 function(s)" in runs["warm"]["stderr"] and "(no trace)" in runs["warm"]["stderr"]


@pytest.mark.slow
def test_a_guard_miss_takes_the_traced_path_and_is_right(runs: dict[str, Any]) -> None:
    """Another shape class (forward at batch 1) and a changed module constant: Dynamo's guard
    fails, ``torch.compile(backend=aotc)`` runs the call, the result is eager's; one INFO line."""
    forward, constant = runs["warm"]["cases"]["forward"], runs["warm"]["cases"]["constant"]
    assert forward["served"] == 2 and forward["traced"] == 1 and forward["miss_err"] < 1e-3, forward
    assert "size mismatch" in forward["miss"], forward["miss"]
    assert constant["served"] == 1 and constant["traced"] == 1 and constant["max_err"] < 1e-3, constant
    assert "SCALE" in constant["miss"], constant["miss"]
    assert runs["warm"]["stderr"].count("not this call") == 2


class _Planted:
    """A pickle that, when loaded, creates a file: the tampered artifact."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return Path.touch, (self.marker,)


def _precompiled_entry(store: Any, target: str) -> Any:
    for row in store.entry_rows():
        meta = json.loads(row["metadata"])
        if meta.get("kind") == "precompiled" and meta.get("target") == target:
            return store.get(row["key"], record=False)
    raise AssertionError(f"no precompiled entry of {target}")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["re-stored", "bytes-on-disk"])
def test_a_tampered_artifact_is_refused_before_it_is_unpickled(runs: dict[str, Any], how: str,
                                                              tmp_path: Path) -> None:
    """The constant case's stored Dynamo pickle replaced by one that plants a file: re-stored
    under its key (unsigned now: the trust policy refuses it) or its bytes rewritten on disk (the
    blob's digest no longer matches). The warm process never unpickles it, says so in one line,
    and traces the call: still eager's result."""
    from aotc.cache import Store

    store_dir = tmp_path / "store"
    shutil.copytree(runs["tmp"] / "to-tamper", store_dir)
    store = Store(store_dir)
    entry = _precompiled_entry(store, "tests.fixtures.precompile_models.Scaled")
    marker = tmp_path / "planted"
    evil = pickle.dumps(_Planted(marker))
    if how == "re-stored":
        store.put(entry.key, entry.name, {"dynamo.0": evil}, factors=entry.factors, metadata=entry.metadata)
    else:
        import zstandard

        blob = Path(store.blob_path(entry.blobs["dynamo.0"].digest))
        blob.chmod(0o644)
        blob.write_bytes(zstandard.compress(evil))  # valid zstd: the size and sha256 checks catch it
    # the traced path compiles its own graph here: signed with the trusted key, so it is served
    got = _run(["constant"], {**runs["warm_env"], "AOTC_STORE": str(store_dir),
                              "AOTC_SIGNING_KEY": str(runs["tmp"] / "signer")})
    case = got["cases"]["constant"]
    assert not marker.exists()
    assert case["functions"] == 0 and case["served"] == 0 and case["traced"] == 2 and case["max_err"] < 1e-3, case
    assert "the stored entry is not used" in got["stderr"]
    assert ("TrustError" if how == "re-stored" else "CorruptedCacheError") in got["stderr"], got["stderr"][-2000:]
