"""Unpacked entries (aotc.cache.unpacked): a warm start loads an entry's kernels and artifacts from
``<store>/store-v1/unpacked/<key>/``, extracted once and re-hashed on every use, instead of a
per-process temp dir that a killed process leaves behind for good.

The store-side tests use hand-made entries (no torch); the warm-start ones the session's compiled
toy model (``compiled``: copied per test, since they damage and collect it) and real processes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from aotc.cache import Store, StoreError, locks, plan_gc, scan, unpacked, verify
from tests.conftest import HELPERS, PYTHON, copy_store, python_env


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def files_of(path: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (inode, mtime_ns) of every file under ``path`` (the lock left out)."""
    return {p.relative_to(path).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


# ---------------------------------------------------------------- the store side, no torch


def test_unpack_once_then_reuse_verified(store: Store) -> None:
    entry = store.put(key("e"), "e", {"k/a": os.urandom(5000), "k/b": b"bee", "art": b"artifact"})
    files = {"k/a": "kernels/ab/a.so", "k/b": "kernels/b.so"}
    with unpacked.unpack(store, entry, files) as first:
        assert first.path == store.base / "unpacked" / entry.key
        assert (first.extracted, first.reused) == (2, 0)
        assert (first.path / "kernels/b.so").read_bytes() == b"bee"
    before = files_of(first.path)
    with unpacked.unpack(store, entry, files) as again:
        assert (again.extracted, again.reused) == (0, 2)
    assert files_of(first.path) == before  # nothing written again
    # another loader asks for a role the directory lacks: only that one is extracted
    with unpacked.unpack(store, entry, {**files, "art": "artifacts/art"}) as more:
        assert (more.extracted, more.reused) == (1, 2)
    assert list(store.tmp_dir.iterdir()) == []  # no staging left


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "replace"])
def test_a_damaged_unpacked_file_is_extracted_again(store: Store, caplog, damage: str) -> None:
    data = os.urandom(20_000)
    entry = store.put(key("d"), "d", {"lib": data, "other": b"fine"})
    files = {"lib": "kernels/x/lib.so", "other": "kernels/other.so"}
    unpacked.unpack(store, entry, files).close()
    lib = store.base / "unpacked" / entry.key / "kernels/x/lib.so"
    if damage == "flip":  # in place: same inode, same size
        with open(lib, "r+b") as f:
            f.seek(10_000)
            f.write(bytes([data[10_000] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(lib, 100)
    elif damage == "delete":
        lib.unlink()
    else:
        lib.unlink()
        lib.write_bytes(os.urandom(20_000))
    with caplog.at_level(logging.WARNING, logger="aotc"):
        with unpacked.unpack(store, entry, files) as got:
            assert (got.extracted, got.reused) == (1, 1)
    assert lib.read_bytes() == data
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if damage == "delete":  # missing is normal (another loader asked for other roles): silent
        assert warnings == []
    else:
        assert len(warnings) == 1 and "did not match their blobs" in warnings[0] and str(lib) in warnings[0]


def test_unsafe_relative_paths_are_refused(store: Store) -> None:
    entry = store.put(key("u"), "u", {"r": b"x"})
    for rel in ["../escape", "/abs/path", "a/../../b", "", ".lock"]:
        with pytest.raises(StoreError, match="not a plain relative path"):
            unpacked.unpack(store, entry, {"r": rel})
    assert not (store.base / "escape").exists()


def test_read_only_store_gets_no_unpacked_dir(store: Store) -> None:
    entry = store.put(key("r"), "r", {"r": b"x"})
    store.read_only = True  # what a store on a read-only volume is opened as
    assert unpacked.unpack(store, entry, {"r": "f"}) is None
    assert not (store.base / "unpacked").exists()


def test_two_unpacks_racing_both_succeed_one_wins(store: Store) -> None:
    """The loser's rename fails (the directory exists): it discards its copy and uses the
    winner's, checked."""
    from concurrent.futures import ThreadPoolExecutor

    entry = store.put(key("race"), "race", {f"r{i}": os.urandom(50_000) for i in range(8)})
    files = {f"r{i}": f"kernels/{i}.so" for i in range(8)}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: unpacked.unpack(store, entry, files), range(4)))
    assert all(g is not None and g.path == got[0].path for g in got)
    assert sorted(g.extracted for g in got) == [0, 0, 0, 8]  # one rename won
    for g in got:
        g.close()
    assert list(store.tmp_dir.iterdir()) == []
    assert sorted(files_of(got[0].path)) == sorted(files.values())


def test_delete_and_gc_remove_unpacked_dirs_but_never_one_in_use(store: Store) -> None:
    a = store.put(key("a"), "a", {"x": os.urandom(30_000)})
    b = store.put(key("b"), "b", {"y": os.urandom(30_000)})
    unpacked.unpack(store, a, {"x": "x.so"}).close()
    held = unpacked.unpack(store, b, {"y": "y.so"})
    s = scan(store)
    assert s.unpacked_size == 60_000 and dict(s.unpacked_dirs) == {a.key: 30_000, b.key: 30_000}
    assert s.size_on_disk >= 60_000 + sum(e.stored_size for e in s.entries)
    store.delete(a.key)
    assert not (store.base / "unpacked" / a.key).exists()
    store.delete(b.key)  # a process is loading from it: kept
    assert (store.base / "unpacked" / b.key).is_dir()
    assert plan_gc(store).unpacked_dirs == (b.key,)
    assert plan_gc(store).execute() == 0  # still held
    held.close()
    plan = plan_gc(store)
    assert plan.expected_freed_size == 30_000 and plan.execute() == 30_000
    assert list((store.base / "unpacked").iterdir()) == []


def test_gc_under_max_size_drops_unpacked_copies_before_entries(store: Store) -> None:
    a = store.put(key("a"), "a", {"x": os.urandom(100_000)})
    unpacked.unpack(store, a, {"x": "x.so"}).close()
    locks.release_hold(store.base, a.key)  # this process stopped serving it (a held one is kept)
    size = scan(store).size_on_disk
    plan = plan_gc(store, max_size=size - 50_000, min_idle=0)
    assert plan.entries == () and plan.unpacked_dirs == (a.key,)
    plan.execute()
    assert store.keys() == [a.key] and not (store.base / "unpacked" / a.key).exists()
    with unpacked.unpack(store, a, {"x": "x.so"}) as again:  # made again on the next load
        assert again.extracted == 1


def test_verify_repair_removes_the_unpacked_dir_of_an_evicted_entry(store: Store) -> None:
    a = store.put(key("bad"), "bad", {"x": os.urandom(10_000)})
    unpacked.unpack(store, a, {"x": "x.so"}).close()
    blob = store.blob_path(a.blobs["x"].digest)
    blob.write_bytes(b"garbage")
    report = verify(store, repair=True)
    assert a.key in report.bad_keys and store.keys() == []
    assert not (store.base / "unpacked" / a.key).exists()


def test_stale_staging_and_private_dirs_are_collected_once_unheld(store: Store) -> None:
    """A process killed while unpacking leaves tmp/unpack-…; one killed while serving through
    Inductor leaves tmp/load-…: gc takes them once nobody holds them and they are old enough."""
    stage = store.tmp_dir / "unpack-0123456789abcdef-1-ab"
    (stage / "kernels").mkdir(parents=True)
    (stage / "kernels" / "k.so").write_bytes(b"12345")
    src = store.root / "src"
    src.mkdir()
    (src / "k.so").write_bytes(b"123")
    private = unpacked.private_dir(store, src, ["k.so"])
    assert (private / "k.so").read_bytes() == b"123"
    assert plan_gc(store).tmp_files == ()  # young
    plan = plan_gc(store, tmp_grace=0)
    assert plan.tmp_files == (stage.name,)  # the private one is held by this live process
    plan.execute()
    assert not stage.exists() and private.exists()
    unpacked._remove_private()  # what exit does
    assert list(store.tmp_dir.iterdir()) == []


# ---------------------------------------------------------------- warm starts, real processes

@pytest.fixture
def toy(compiled, tmp_path):
    """A private copy of the session's compiled store (toy-llama, 2 layers) without any unpacked
    directory yet, its manifest and key."""
    _tmp, store, results = compiled
    root = tmp_path / "store"
    copy_store(store.root, root)
    for d in (root / "store-v1" / "unpacked", root / "store-v1" / "tmp"):
        shutil.rmtree(d, ignore_errors=True)
    (root / "store-v1" / "tmp").mkdir()
    return root, results[2][0], results[2][1].key


def _warm_start(manifest: Path, root: Path) -> tuple[dict, str]:
    """A fresh process loads and runs it (sizes 1, 4, 9); its results equal eager's."""
    out = subprocess.run([PYTHON, str(HELPERS / "warm_start.py"), str(manifest), str(root), "1", "4", "9"],
                         capture_output=True, text=True, env=python_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(err <= 1e-4 for err in report["errs"].values()), report["errs"]  # equal to eager
    assert report["counters"]["compiles"] == 0 and report["counters"]["traces"] == 0
    return report, out.stderr


_SERVE = """
import sys, time
import aotc
from aotc.manifest import load_manifest
from aotc.model.build import make_named_inputs
m = load_manifest(sys.argv[1])
runner = aotc.load(m, store=sys.argv[2])
runner(**make_named_inputs(m, 4, seed=1))
print("serving", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["fast", "inductor"])
def test_a_killed_warm_start_leaves_no_kernels_in_tmpdir(toy, tmp_path, loader) -> None:
    root, manifest, key_ = toy
    tmpdir = tmp_path / "child-tmp"
    tmpdir.mkdir()
    env = {**python_env(), "TMPDIR": str(tmpdir)}
    if loader == "inductor":
        env["AOTC_LOADER"] = "inductor"
    child = subprocess.Popen([PYTHON, "-c", _SERVE, str(manifest), str(root)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.strip() == "serving", child.stderr.read() if child.stderr else ""
        child.send_signal(signal.SIGKILL)  # no atexit, no finally
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    left = sorted(p.relative_to(tmpdir).as_posix() for p in tmpdir.rglob("*.so"))
    assert left == [] and not list(tmpdir.glob("aotc-load-*")), left[:5]
    kernels = root / "store-v1" / "unpacked" / key_ / "kernels"
    assert list(kernels.rglob("*.so"))  # they were loaded from the store
    store = Store(root)
    try:
        private = [p.name for p in store.tmp_dir.iterdir()]
        # Inductor wrote beside its kernels in a directory of the killed process's own: gc's,
        # now that nobody holds it (the fast path needs none)
        assert len(private) == (1 if loader == "inductor" else 0), private
        plan_gc(store, tmp_grace=0).execute()
        assert list(store.tmp_dir.iterdir()) == []
        assert list(kernels.rglob("*.so"))  # the entry's copy stays for the next process
    finally:
        store.close()


@pytest.mark.slow
def test_a_second_warm_start_reuses_the_unpacked_copy(toy) -> None:
    root, manifest, key_ = toy
    first, _ = _warm_start(manifest, root)
    where = root / "store-v1" / "unpacked" / key_
    seen = files_of(where)
    assert any(name.endswith(".so") for name in seen) and any(n.startswith("artifacts/") for n in seen)
    second, stderr = _warm_start(manifest, root)
    assert files_of(where) == seen  # the same files (inode, mtime): nothing extracted again
    assert "did not match" not in stderr
    assert first["errs"].keys() == second["errs"].keys()
    assert list((root / "store-v1" / "tmp").iterdir()) == []
    print(f"\nwarm start: first {first['load_s']:.3f}s (read+verify "
          f"{first['phases']['read+verify']:.3f}s), second {second['load_s']:.3f}s "
          f"(read+verify {second['phases']['read+verify']:.3f}s)")


@pytest.mark.slow
def test_a_tampered_unpacked_kernel_is_never_loaded(toy) -> None:
    root, manifest, key_ = toy
    _warm_start(manifest, root)
    where = root / "store-v1" / "unpacked" / key_
    libs = sorted((where / "kernels").rglob("*.so"))
    records = sorted((where / "artifacts").iterdir())
    good = {p: p.read_bytes() for p in (libs[0], libs[1], records[0])}
    inode = libs[0].stat().st_ino
    with open(libs[0], "r+b") as f:  # bytes changed in place: same size, same inode
        f.seek(len(good[libs[0]]) // 2)
        f.write(b"\xde\xad\xbe\xef")
    os.truncate(libs[1], 64)
    records[0].write_bytes(b'{"not": "the record"}')
    _report, stderr = _warm_start(manifest, root)  # runs, and equals eager
    for p, data in good.items():
        assert p.read_bytes() == data
    assert libs[0].stat().st_ino != inode  # replaced by a fresh file, never patched
    notes = [ln for ln in stderr.splitlines() if "did not match their blobs" in ln]
    assert len(notes) == 1 and "3 unpacked file(s)" in notes[0], stderr[-2000:]


@pytest.mark.slow
def test_a_sound_unpacked_copy_serves_while_verify_still_finds_a_damaged_blob(toy) -> None:
    """The copy is checked against the digests the entry records (and a signature covers), so its
    bytes are the blob's: a load uses it without decompressing the blob; `aotc verify` re-hashes
    the blobs themselves and reports the damage, and --repair evicts the entry with its copy."""
    root, manifest, key_ = toy
    _warm_start(manifest, root)
    store = Store(root)
    try:
        entry = store.get(key_, record=False)
        role = next(r for r in entry.blobs if r.startswith("kernel"))
        blob = store.blob_path(entry.blobs[role].digest)
        blob.write_bytes(b"damaged")
        _warm_start(manifest, root)  # served from the verified copy
        report = verify(store, repair=True)
        assert key_ in report.bad_keys and key_ not in store.keys()
        assert not (root / "store-v1" / "unpacked" / key_).exists()
    finally:
        store.close()


@pytest.mark.slow
def test_gc_removes_the_unpacked_dir_of_a_deleted_or_evicted_entry(toy) -> None:
    root, manifest, key_ = toy
    _warm_start(manifest, root)
    where = root / "store-v1" / "unpacked" / key_
    store = Store(root)
    try:
        s = scan(store)
        assert dict(s.unpacked_dirs)[key_] > 0 and s.size_on_disk > s.unpacked_size > 0
        evict = plan_gc(store, max_size=0, min_idle=0)  # least recently used: its copy goes first
        assert key_ in [e.key for e in evict.entries] and key_ in evict.unpacked_dirs
        # an entry deleted by a process that left its directory (an older aotc, a crash)
        with store.index.write() as conn:
            for table in ("entry_blobs", "signatures", "entries"):
                conn.execute(f"DELETE FROM {table} WHERE key = ?", (key_,))
        assert where.is_dir()
        plan = plan_gc(store)
        assert plan.unpacked_dirs == (key_,) and plan.expected_freed_size >= dict(s.unpacked_dirs)[key_]
        plan.execute()
        assert not where.exists()
    finally:
        store.close()


@pytest.mark.slow
def test_racing_first_warm_starts_all_succeed(toy) -> None:
    root, manifest, key_ = toy
    procs = [subprocess.Popen([PYTHON, str(HELPERS / "warm_start.py"), str(manifest), str(root), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())
             for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert all(e <= 1e-4 for e in json.loads(out.strip().splitlines()[-1])["errs"].values())
    assert [p.name for p in (root / "store-v1" / "unpacked").iterdir()] == [key_]
    assert list((root / "store-v1" / "tmp").iterdir()) == []  # the losers' copies are gone


@pytest.mark.slow
def test_a_read_only_store_still_loads(toy, tmp_path) -> None:
    """A store on a read-only volume cannot hold unpacked copies: the warm start extracts into a
    per-process temp dir as before (removed at exit) and writes nothing into the store."""
    from tests.test_serving import _read_only_mount_works

    why = _read_only_mount_works()
    if why:
        pytest.skip(why)
    root, manifest, _key = toy
    mnt, tmpdir = tmp_path / "mnt", tmp_path / "child-tmp"
    mnt.mkdir()
    tmpdir.mkdir()
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    script = " && ".join([
        "mount --make-rprivate /", f"mount --bind {root} {mnt}", f"mount -o remount,bind,ro {mnt}",
        f"! touch {mnt}/probe 2>/dev/null",
        f"{PYTHON} {HELPERS / 'warm_start.py'} {manifest} {mnt} 1 4 9 > {tmp_path}/run.json"])
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         env={**python_env(), "TMPDIR": str(tmpdir)}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "run.json").read_text().strip().splitlines()[-1])
    assert all(err <= 1e-4 for err in report["errs"].values()) and report["counters"]["compiles"] == 0
    assert "is read-only" in out.stderr and "cannot unpack" not in out.stderr
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before
    assert list(tmpdir.iterdir()) == []  # its own directory, removed at exit


@pytest.mark.slow
def test_a_read_only_store_object_loads_in_process(toy) -> None:
    """The same fallback without a mount: a Store opened read-only, loaded from in this process."""
    from aotc.manifest import load_manifest
    from aotc.model.build import build_model, make_inputs
    from aotc.runtime.loader import _WORKDIRS, load_entry

    root, manifest, key_ = toy
    store = Store(root)
    try:
        store.read_only = True
        m = load_manifest(manifest)
        model = build_model(m)
        before = len(_WORKDIRS)
        runner = load_entry(store.get(key_, record=False), store, model)
        x = make_inputs(m, 5)
        import torch

        with torch.no_grad():
            assert torch.allclose(runner(*x), model(*x), atol=1e-4, rtol=1e-4)
        assert len(_WORKDIRS) == before + 1 and any(_WORKDIRS[-1].rglob("*.so"))
        assert not (root / "store-v1" / "unpacked").exists()
    finally:
        store.close()
