"""Suite 4 — concurrency, in real processes. 4 `aotc compile` of one manifest into one empty store
at once → all exit 0, one entry, each piece compiled once (a task lock in the key's work
directory; the others reuse). 8 `aotc run` while `aotc gc --max-size 0` runs repeatedly → every
run succeeds (gc spares entries read in the last --min-idle seconds, and a run marks its entry
before reading a byte); once idle, the same gc empties the store cleanly."""

from __future__ import annotations

import subprocess

import pytest

from aotc.cache import Store, verify
import json

from tests.conftest import AOTC_CLI, PYTHON, copy_store, python_env, tiny_manifest

pytestmark = pytest.mark.slow


def _aotc(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*AOTC_CLI, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=python_env())


def test_eight_runs_while_gc_evicts_everything(compiled, tmp_path) -> None:
    _tmp, store, results = compiled
    root = tmp_path / "store"
    copy_store(store.root, root)  # its entries are as old as the session: gc may take them
    manifest = str(results[2][0])
    first = _aotc("--store", str(root), "run", manifest, "--sizes", "3")
    assert first.wait(300) == 0, first.stderr.read()[-2000:] if first.stderr else ""
    runs = [_aotc("--store", str(root), "run", manifest, "--sizes", "1,5,9") for _ in range(8)]
    gcs = 0
    while any(r.poll() is None for r in runs):
        gc = _aotc("--store", str(root), "gc", "--max-size", "0", "--json")
        assert gc.wait(120) == 0, gc.stderr.read()[-2000:] if gc.stderr else ""
        gcs += 1
    failed = [(r.returncode, r.stderr.read()[-500:]) for r in runs if r.returncode != 0]
    print(f"8 runs alongside {gcs} gc passes: {8 - len(failed)} succeeded")
    assert not failed and gcs >= 1
    s = Store(root)
    key = next(k for k in s.keys() if s.get(k, record=False).name == "toy-2")
    assert verify(s).ok
    done = _aotc("--store", str(root), "gc", "--max-size", "0", "--min-idle", "0")
    assert done.wait(120) == 0
    assert key not in s.keys() and s.keys() == [] and verify(s).ok


def test_four_concurrent_compiles_of_one_manifest(tmp_path) -> None:
    manifest = str(tiny_manifest(tmp_path, "toy-race"))
    root = str(tmp_path / "store")
    procs = [_aotc("--store", root, "compile", manifest, "--json") for _ in range(4)]
    outs = []
    for p in procs:  # communicate: a child writing more than a pipe holds never blocks
        out, err = p.communicate(timeout=600)
        outs.append((p.returncode, out, err))
    failed = [(rc, err[-800:]) for rc, _out, err in outs if rc != 0]
    results = [json.loads(out) for rc, out, _err in outs if rc == 0]
    keys = {r["key"] for r in results}
    built = sum(r["compiles"] for r in results)
    print(f"4 concurrent compiles of one manifest: {len(results)}/4 exit 0, {len(keys)} key, "
          f"{built} Inductor compiles in all (2 unique pieces)")
    assert not failed, failed
    s = Store(root)
    assert len(keys) == 1 and s.keys() == list(keys) and verify(s).ok
    assert built == 2  # each piece once; the other compiles waited for it and reused it
    assert not [p for p in s.tmp_dir.iterdir() if ".removing-" not in p.name]  # cleaned up
    s.close()
