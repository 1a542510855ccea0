"""Suite 5 — staleness: whatever changed since the compile (the model's source, a manifest field,
the toolchain, a code-changing Inductor setting), a fresh `aotc run` process misses cleanly (one
line, exit 1, no output: never a stale load) and `aotc explain` names the factor that changed."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

import aotc
from tests.conftest import AOTC_CLI, PYTHON, copy_store, python_env, tiny_manifest, toy_manifest

pytestmark = pytest.mark.slow


def _source_edit(tmp: Path, root: Path) -> tuple[Path, dict[str, str], str]:
    src = tmp / "stalemodel.py"
    shutil.copy(Path(aotc.__file__).parent / "models" / "toy_llama.py", src)
    manifest = tiny_manifest(tmp, "stale-src", factory="stalemodel.py:build")
    aotc.compile(manifest, store=root)
    # a real edit: the MLP's activation changes; the old artifacts would compute the old model
    text = src.read_text()
    assert "silu" in text
    src.write_text(text.replace("silu", "gelu", 1))
    return manifest, {}, "code.stalemodel.py"


def _manifest_field(tmp: Path, root: Path) -> tuple[Path, dict[str, str], str]:
    return toy_manifest(tmp, 2, max_tokens=512), {}, "manifest.max_tokens"


def _toolchain(tmp: Path, root: Path) -> tuple[Path, dict[str, str], str]:
    """A C++ compiler upgrade: CXX names a wrapper that reports another version."""
    real = shutil.which("g++") or "g++"
    cxx = tmp / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text("#!/bin/sh\n"
                   'case "$*" in *--version*) echo "g++ (Simulated 99.1) 99.1.0"; exit 0;; esac\n'
                   f'exec {real} "$@"\n')
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    return toy_manifest(tmp, 2), {"CXX": str(cxx)}, "toolchain.cxx"


def _inductor_setting(tmp: Path, root: Path) -> tuple[Path, dict[str, str], str]:
    return toy_manifest(tmp, 2), {"TORCHINDUCTOR_FREEZING": "1"}, "inductor.env.TORCHINDUCTOR_FREEZING"


CHANGES = [_source_edit, _manifest_field, _toolchain, _inductor_setting]
_seen: list[str] = []


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.strip("_") for c in CHANGES])
def test_change_is_a_clean_miss_that_explain_names(compiled, tmp_path, change) -> None:
    _tmp, store, _results = compiled
    root = tmp_path / "store"
    copy_store(store.root, root)
    manifest, env_extra, factor = change(tmp_path, root)
    env = {**python_env(), **env_extra}
    base = [*AOTC_CLI, "--store", str(root)]
    run = subprocess.run([*base, "run", str(manifest), "--sizes", "3", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1 and run.stdout == "", (run.returncode, run.stdout[-300:], run.stderr[-1500:])
    line = run.stderr.strip()
    assert len(line.splitlines()) == 1 and "no store entry" in line and "aotc explain" in line, line
    out = subprocess.run([*base, "explain", str(manifest), "--json"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    report = json.loads(out.stdout)
    assert not report["hit"] and report["closest"]
    assert any(d.startswith(factor) for d in report["differences"]), report["differences"]
    _seen.append(factor)
    print(f"staleness suite: {len(_seen)}/{len(CHANGES)} changes missed cleanly and were named; "
          f"this one: {[d for d in report['differences'] if d.startswith(factor)][0]}")
