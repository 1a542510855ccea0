"""The key's promise, tried from outside: one tiny model stored through all three front doors
(a manifest, ``torch.compile(backend="aotc")``, ``aotc.precompile``) by a process with default
settings; then fresh processes, one change each, look it up again (tests/helpers/key_probe.py).
What cannot change a compiled artifact must hit (another cwd, temp dir, Inductor cache dir, home,
hash seed, store location, environment noise); what can must miss, and ``aotc explain``'s factor
diff names it (matmul precision, TF32, reduced-precision reductions, deterministic algorithms,
Inductor settings by variable or in-process, the thread count kernels are built for, dtype).
The wheel and another install path are tried in tests/test_install.py with the same probe."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HELPERS, PYTHON, copy_store, python_env, tiny_manifest

pytestmark = pytest.mark.slow

PROBE = HELPERS / "key_probe.py"
DOORS = ("manifest", "backend", "precompiled")


def probe(store: Path, manifest: Path, change: str, cwd: Path, env: dict[str, str],
          build: bool = False) -> dict[str, Any]:
    """Run the probe in a fresh process; its JSON line."""
    res = subprocess.run([PYTHON, str(PROBE), str(store), str(manifest), change, *(["--build"] if build else [])],
                         capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def base_env(home: Path) -> dict[str, str]:
    """The build's environment: its own temp dir, Inductor cache dir and home."""
    env = python_env()
    for name in [n for n in env if n.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_"))]:
        del env[name]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "POD_IP", "VLLM_RAY_BUNDLE_INDICES", "XDG_CACHE_HOME"):
        env.pop(name, None)
    for sub in ("tmp", "inductor", "home"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env.update(TMPDIR=str(home / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"),
               HOME=str(home / "home"), PYTHONHASHSEED="0")
    return env


# must hit: (id, change passed to the probe, environment changes, whether the store is a copy)
MUST_HIT: list[tuple[str, dict[str, str], bool]] = [
    ("same", {}, False),
    ("cwd", {}, False),  # the probe runs in another directory (below)
    ("tmpdir", {"TMPDIR": "{other}/tmp"}, False),
    ("inductor-cache-dir", {"TORCHINDUCTOR_CACHE_DIR": "{other}/inductor"}, False),
    ("home-and-xdg", {"HOME": "{other}/home", "XDG_CACHE_HOME": "{other}/xdg"}, False),
    ("matmul-highest", {}, False),  # set_float32_matmul_precision("highest"), as vLLM's workers call it
    ("hash-seed", {"PYTHONHASHSEED": "12345"}, False),
    ("store-copied", {}, True),
    ("environment-noise", {"POD_IP": "10.1.2.3", "HOSTNAME": "replica-7", "RANK": "3", "LOCAL_RANK": "1",
                           "WORLD_SIZE": "8", "VLLM_RAY_BUNDLE_INDICES": "0,1", "MASTER_ADDR": "10.0.0.1",
                           "CUDA_VISIBLE_DEVICES": "3"}, False),
]

# must miss: (in-process change, environment changes, a factor path prefix the diff must name)
MUST_MISS: list[tuple[str, dict[str, str], str]] = [
    ("matmul-medium", {}, "global.cuda_matmul_settings.torch.backends.cuda.matmul.fp32_precision"),
    ("matmul-high", {}, "global.cuda_matmul_settings.torch.backends.cuda.matmul.fp32_precision"),
    ("tf32", {}, "global.cuda_matmul_settings.torch.backends.cuda.matmul.fp32_precision"),
    ("cudnn-tf32-off", {}, "global.cudnn.torch.backends.cudnn.conv.fp32_precision"),
    ("fp16-reduction-off", {}, "global.cuda_matmul_settings.torch.backends.cuda.matmul.allow_fp16"),
    ("bf16-reduction-off", {}, "global.cuda_matmul_settings.torch.backends.cuda.matmul.allow_bf16"),
    ("deterministic", {}, "global.deterministic_algorithms_settings"),
    ("inductor-in-process", {}, "inductor.values.epilogue_fusion"),
    ("threads-1", {}, "inductor.cpu_threads"),
    ("dtype-f64", {}, ""),
    ("none", {"TORCHINDUCTOR_FREEZING": "1"}, "inductor.env.TORCHINDUCTOR_FREEZING"),
    ("none", {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, "inductor.env.TORCHINDUCTOR_MAX_AUTOTUNE"),
    ("none", {"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}, "inductor.values.cpp.dynamic_threads"),
]


def _miss_id(case: tuple[str, dict[str, str], str]) -> str:
    return case[0] if case[0] != "none" else next(iter(case[1]))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The stored entries (built once) and every probe's result, two processes at a time."""
    tmp = tmp_path_factory.mktemp("soundness")
    build_dir, other = tmp / "build", tmp / "other"
    build_dir.mkdir()
    other.mkdir()
    manifest = tiny_manifest(tmp, "sound-tiny")
    store = tmp / "store"
    env = base_env(build_dir)
    probe(store, manifest, "none", build_dir, env, build=True)
    copied = tmp / "elsewhere" / "store"
    copy_store(store, copied)
    (other / "xdg").mkdir()
    base_env(other)

    jobs: dict[str, Any] = {}
    for name, changes, use_copy in MUST_HIT:
        e = {**env, **{k: v.format(other=other) for k, v in changes.items()}}
        cwd = other if name == "cwd" else build_dir
        change = name if name.startswith("matmul-") else "none"
        jobs[f"hit:{name}"] = (copied if use_copy else store, change, cwd, e)
    for case in MUST_MISS:
        jobs[f"miss:{_miss_id(case)}"] = (store, case[0], build_dir, {**env, **case[1]})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(probe, s, manifest, c, cwd, e) for k, (s, c, cwd, e) in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("case", [c[0] for c in MUST_HIT])
def test_what_cannot_change_an_artifact_hits(results, case: str) -> None:
    got = results[f"hit:{case}"]
    assert {door: got[door]["hit"] for door in DOORS} == dict.fromkeys(DOORS, True), got


@pytest.mark.parametrize("case", MUST_MISS, ids=[_miss_id(c) for c in MUST_MISS])
def test_what_changes_an_artifact_misses_and_is_named(results, case) -> None:
    got = results[f"miss:{_miss_id(case)}"]
    # a precompiled entry's example inputs (dtypes included) are checked by Dynamo's own guards
    # at every call, not by the lookup: another dtype takes the traced path there
    doors = DOORS if case[0] != "dtype-f64" else ("manifest", "backend")
    assert {door: got[door]["hit"] for door in doors} == dict.fromkeys(doors, False), got
    if case[2]:  # the factor that changed is named, for every front door
        for door in doors:
            assert any(d.startswith(case[2]) for d in got[door]["diffs"]), (door, got[door]["diffs"])


def test_the_probe_ran_this_checkout(results) -> None:
    """The probes imported the aotc under test (not an installed copy)."""
    here = Path(__file__).resolve().parent.parent / "aotc" / "__init__.py"
    assert {os.path.realpath(r["aotc_file"]) for r in results.values()} == {str(here)}
