"""The store across real processes: writers killed with SIGKILL mid-put, concurrent writers and
readers. Nothing here is simulated: separate interpreters, real signals, one store on disk."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from aotc.cache import Store, plan_gc, scan, verify
from tests.conftest import HELPERS, PYTHON, python_env

WORKER = str(HELPERS / "store_worker.py")


@pytest.mark.parametrize("point", ["mid-stage", "after-first-rename", "before-index", "in-transaction"])
def test_sigkill_during_put_leaves_no_partial_entry(tmp_path: Path, point: str) -> None:
    root = tmp_path / "store"
    Store(root).put("0" * 64, "survivor", {"x": b"keep me"})
    proc = subprocess.run([PYTHON, WORKER, "crash", str(root), point], env=python_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = Store(root)
    # no partial entry visible: only the survivor is there, whole
    assert store.keys() == ["0" * 64]
    assert store.read_blob(store.get("0" * 64), "x") == b"keep me"
    report = verify(store)
    assert report.ok, report.problems
    leftovers = plan_gc(store, tmp_grace=0)
    if point in ("after-first-rename", "before-index"):
        assert leftovers.orphan_blobs, "the published blobs of the dead put are orphans"
    if point == "mid-stage":
        assert leftovers.tmp_files
    leftovers.execute()
    after = scan(store, tmp_grace=0)
    assert not after.orphan_blobs and not after.stale_tmp_files and not after.warnings
    blob_files = [p for p in store.blobs_dir.rglob("*") if p.is_file()]
    assert len(blob_files) == 1  # just the survivor's blob
    assert verify(store).ok


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store(root)
    env = python_env()
    writers = [subprocess.Popen([PYTHON, WORKER, "write", str(root), str(i), "6"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(4)]
    readers = [subprocess.Popen([PYTHON, WORKER, "read", str(root), "15"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(4)]
    for proc in writers + readers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.startswith("ok"), (out, err)
    store = Store(root)
    keys = store.keys()
    assert len(keys) == 6 + 4 * 6  # overlapping entries collapse to one each
    report = verify(store)
    assert report.ok and not report.problems, report.problems
    # 3 shared payloads + 6 "own-i" + 24 writer-own blobs, each stored once
    assert len([p for p in store.blobs_dir.rglob("*") if p.is_file()]) == 3 + 6 + 24
