"""The store: round trips, dedup, corruption handling (real sqlite + zstd on disk)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from aotc.cache import CacheMiss, CorruptedCacheError, Store, StoreError, plan_gc, scan, verify


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 1000, (1 << 20) + 7, 64 << 20])
def test_round_trip_sizes(store: Store, tmp_path: Path, size: int) -> None:
    block = os.urandom(min(size, 1 << 20))
    data = (block * (size // max(len(block), 1) + 1))[:size]
    assert len(data) == size
    entry = store.put(key(f"s{size}"), "rt", {"blob": data}, factors={"a": 1}, metadata={"m": [1, 2]})
    got = store.get(entry.key)
    assert got.factors == {"a": 1} and got.metadata == {"m": [1, 2]}
    assert got.blobs["blob"].size == size
    assert store.read_blob(got, "blob") == data
    out = store.extract_blob(got, "blob", tmp_path / "out" / "blob.bin")
    assert out.read_bytes() == data


def test_put_from_file_streams(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * (5 << 20) + os.urandom(1000))
    entry = store.put(key("file"), "f", {"lib": src})
    assert entry.blobs["lib"].digest == hashlib.sha256(src.read_bytes()).hexdigest()
    assert entry.blobs["lib"].stored_size < entry.blobs["lib"].size // 10  # compressed
    assert store.read_blob(entry, "lib") == src.read_bytes()


def test_layout_and_markers(store: Store) -> None:
    assert (store.root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert (store.root / ".gitignore").read_text() == "*\n"
    entry = store.put(key("x"), "x", {"r": b"abc"})
    digest = entry.blobs["r"].digest
    assert (store.root / "store-v1" / "blobs" / digest[:2] / digest).is_file()
    assert (store.root / "store-v1" / "index.sqlite").is_file()
    conn = sqlite3.connect(store.index_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"entries", "blobs", "entry_blobs", "events"} <= tables


def test_shared_blob_stored_once_and_survives_delete(store: Store) -> None:
    shared = os.urandom(100_000)
    a = store.put(key("a"), "a", {"s": shared, "own": b"a"})
    b = store.put(key("b"), "b", {"s": shared, "own": b"b"})
    assert a.blobs["s"].digest == b.blobs["s"].digest
    files = [p for p in store.blobs_dir.rglob("*") if p.is_file()]
    assert len(files) == 3
    freed = store.delete(a.key)
    assert freed > 0
    assert not store.has(a.key)
    assert store.read_blob(store.get(b.key), "s") == shared
    assert store.read_blob(store.get(b.key), "own") == b"b"
    assert len([p for p in store.blobs_dir.rglob("*") if p.is_file()]) == 2
    assert verify(store).ok


def test_put_same_key_twice_leaves_one_entry(store: Store) -> None:
    store.put(key("k"), "first", {"x": b"1"})
    store.put(key("k"), "second", {"x": b"2"})
    assert store.keys() == [key("k")]
    entry = store.get(key("k"))
    assert entry.name == "second" and store.read_blob(entry, "x") == b"2"
    assert plan_gc(store).orphan_blobs  # the old "1" blob is now unused
    plan_gc(store).execute()
    assert verify(store).ok and not verify(store).problems


def test_miss_and_hit_accounting(store: Store) -> None:
    with pytest.raises(CacheMiss):
        store.get(key("nope"))
    store.put(key("k"), "k", {"x": b"1"})
    before = store.get(key("k"), record=False)
    store.get(key("k"))
    store.get(key("k"))
    after = store.get(key("k"), record=False)
    assert after.hits == 2 and after.last_used >= before.last_used
    s = scan(store)
    assert (s.hits, s.misses) == (2, 1)


def test_bad_key_rejected(store: Store) -> None:
    with pytest.raises(StoreError, match="64 lowercase hex"):
        store.put("../../etc/passwd", "x", {"a": b""})


def test_store_never_imports_torch(tmp_path: Path) -> None:
    import subprocess

    code = ("import sys; from aotc.cache import Store, scan, verify; import aotc.cli; "
            f"s = Store({str(tmp_path)!r}); scan(s); verify(s); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- corruption -----------------------------------------------------------------------------

def _blob_file(store: Store, entry, role: str) -> Path:
    return store.blob_path(entry.blobs[role].digest)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete(path: Path) -> None:
    path.unlink()


def _swap(path: Path) -> None:  # a valid zstd frame of other bytes: only the hash can tell
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress(b"y" * 200_000))


@pytest.mark.parametrize("damage", [_flip, _truncate, _delete, _swap])
def test_damaged_blob_never_returned(store: Store, tmp_path: Path, damage) -> None:
    good = store.put(key("good"), "good", {"x": os.urandom(50_000)})
    data = os.urandom(100_000) + b"z" * 100_000
    entry = store.put(key("bad"), "bad", {"x": data, "other": b"fine"})
    damage(_blob_file(store, entry, "x"))
    with pytest.raises(CorruptedCacheError) as info:
        store.read_blob(store.get(entry.key), "x")
    msg = str(info.value)
    assert entry.key[:16] in msg and "'x'" in msg and "aotc verify --repair" in msg
    # marked bad: never used again, not even through another path
    with pytest.raises(CorruptedCacheError):
        store.get(entry.key)
    assert not store.has(entry.key)
    dest = tmp_path / "dest.bin"
    with pytest.raises(CorruptedCacheError):
        store.extract_blob(entry, "x", dest)
    assert not dest.exists() and not list(tmp_path.glob(".dest.bin*"))
    report = verify(store)
    assert not report.ok and report.bad_keys == (entry.key,)
    assert any(p.role == "x" and p.key == entry.key for p in report.problems)
    repaired = verify(store, repair=True, tmp_grace=0)
    assert repaired.repaired
    assert store.keys() == [good.key]
    after = verify(store)
    assert after.ok and not after.problems
    assert store.read_blob(store.get(good.key), "x") == store.read_blob(good, "x")


def test_damage_detected_by_verify_before_any_get(store: Store) -> None:
    entry = store.put(key("e"), "e", {"x": os.urandom(10_000)})
    _flip(_blob_file(store, entry, "x"))
    report = verify(store)
    assert not report.ok
    assert [p.kind for p in report.problems] == ["corrupt"]


@pytest.mark.parametrize("sql", [
    "UPDATE entries SET metadata = 'not json{' ",
    "UPDATE entry_blobs SET digest = '../../../etc/passwd'",
    "DELETE FROM blobs",
    "UPDATE entries SET factors = '[1, 2]'",
])
def test_garbage_index_rows(store: Store, sql: str) -> None:
    entry = store.put(key("g"), "g", {"x": b"payload"})
    conn = sqlite3.connect(store.index_path)
    conn.execute(sql)
    conn.commit()
    conn.close()
    with pytest.raises(CorruptedCacheError):
        e = store.get(entry.key)
        store.read_blob(e, "x")
    s = scan(store)
    assert s.warnings  # collected, not raised
    report = verify(store)
    assert not report.ok and entry.key in report.bad_keys
    verify(store, repair=True, tmp_grace=0)
    assert store.keys() == []
    assert verify(store).ok


def test_gc_lru_by_last_use(store: Store) -> None:
    import time

    entries = []
    for i in range(4):
        entries.append(store.put(key(f"e{i}"), f"e{i}", {"x": os.urandom(200_000)}))
        time.sleep(0.01)
    store.get(entries[0].key)  # e0 is now the most recently used
    total = scan(store).size_on_disk
    plan = plan_gc(store, max_size=total - 1, min_idle=0)
    assert [e.name for e in plan.entries] == ["e1"]
    plan = plan_gc(store, max_size=total // 2 + 10, min_idle=0)
    assert [e.name for e in plan.entries] == ["e1", "e2"]
    expected = plan.expected_freed_size
    assert store.keys() == [e.key for e in entries]  # planning deleted nothing
    freed = plan.execute()
    assert freed == expected
    assert sorted(store.keys()) == sorted([entries[0].key, entries[3].key])
    assert scan(store).size_on_disk <= total // 2 + 10
    assert verify(store).ok


def _backdate(store: Store, key_: str, seconds: float) -> None:
    import sqlite3
    import time

    with sqlite3.connect(store.base / "index.sqlite") as conn:
        conn.execute("UPDATE entries SET created = ?, last_used = ? WHERE key = ?",
                     (time.time() - seconds, time.time() - seconds, key_))


def test_gc_never_evicts_an_entry_in_use(store: Store) -> None:
    """Entries written or read within min_idle are spared, and a read between planning and
    executing (a loader marking its entry) is seen under the write lock."""
    a = store.put(key("a"), "a", {"x": os.urandom(100_000)})
    b = store.put(key("b"), "b", {"x": os.urandom(100_000)})
    assert plan_gc(store, max_size=0).entries == ()  # both just written
    _backdate(store, a.key, 3600)
    assert [e.name for e in plan_gc(store, max_size=0).entries] == ["a"]
    _backdate(store, b.key, 3600)
    plan = plan_gc(store, max_size=0)
    assert sorted(e.name for e in plan.entries) == ["a", "b"]
    store.get(a.key)  # a loader marks a in use after the plan was made
    plan.execute()
    assert store.keys() == [a.key]
    assert len(store.read_blob(store.get(a.key), "x")) == 100_000
    assert verify(store).ok
    plan_gc(store, max_size=0, min_idle=0).execute()
    assert store.keys() == [] and verify(store).ok


def test_gc_removes_stale_tmp_only_after_grace(store: Store) -> None:
    stale = store.tmp_dir / "blob-123-abc.zst"
    stale.write_bytes(b"partial")
    assert plan_gc(store).tmp_files == ()  # may belong to a live writer
    plan = plan_gc(store, tmp_grace=0)
    assert plan.tmp_files == (stale.name,)
    plan.execute()
    assert not stale.exists()


def test_scan_reports_metadata_and_json(store: Store) -> None:
    store.put(key("m"), "model", {"a": b"1", "b": b"22"}, metadata={"pieces": 5, "shapes": ["dyn", "8"]})
    s = scan(store)
    (e,) = s.entries
    assert (e.name, e.blob_count, e.size, e.pieces, e.shapes) == ("model", 2, 3, 5, ("dyn", "8"))
    assert e.size_str == "3B" and e.key_short == key("m")[:12]
    json.dumps(s.to_json())


def test_compile_workdirs_gc_only_when_idle_and_old(store: Store) -> None:
    """A compile's checkpoint directory (tmp/compile-<key>/) is gc'd only when nobody holds its
    lock and its newest file is older than the grace; the last holder to finish removes it."""
    import time as _time

    from aotc.cache import workdirs

    with workdirs.claim(store.tmp_dir, "a" * 32) as held:
        (held.path / "piece-dyn").mkdir()
        (held.path / "piece-dyn" / "done.json").write_text("{}")
        assert workdirs.in_use(held.path)
        assert plan_gc(store, tmp_grace=0).tmp_files == ()  # in use: spared even at grace 0
        with workdirs.claim(store.tmp_dir, "a" * 32) as other:  # a concurrent compile of the key
            other.finished()
        assert held.path.exists()  # the other one finished first: not removed under us
    assert held.path.exists() and not workdirs.in_use(held.path)  # not finished: kept to resume
    assert plan_gc(store).tmp_files == ()  # young: a compile may resume from it
    old = _time.time() - 7200
    for p in [held.path, *held.path.rglob("*")]:
        os.utime(p, (old, old))
    plan = plan_gc(store)
    assert plan.tmp_files == (held.path.name,) and plan.expected_freed_size == 2
    assert plan.execute() == 2 and not held.path.exists()
    with workdirs.claim(store.tmp_dir, "b" * 32) as last:
        last.finished()
    assert not last.path.exists() and list(store.tmp_dir.iterdir()) == []


def test_index_damaged_past_its_first_page_is_reported_and_repaired(tmp_path: Path) -> None:
    """A page overwritten in the middle of index.sqlite (size and header intact) opens fine;
    `verify_at` still finds it (quick_check), and --repair sets the file aside."""
    from aotc.cache import verify_at

    s = Store(tmp_path / "s")
    for i in range(60):
        s.put(key(f"k{i}"), f"e{i}", {"x": os.urandom(64), "meta": json.dumps({"i": i}).encode() * 20})
    s.close()
    path = s.index_path
    data = bytearray(path.read_bytes())
    assert len(data) >= 8 * 4096
    data[4 * 4096: 5 * 4096] = os.urandom(4096)
    path.write_bytes(bytes(data))
    report = verify_at(tmp_path / "s")
    assert not report.ok and report.index_problem and report.problems[0].kind == "index-corrupt"
    fixed = verify_at(tmp_path / "s", repair=True, tmp_grace=0)
    assert fixed.ok and fixed.repaired
    assert list(path.parent.glob("index.sqlite.corrupt-*"))
    after = Store(tmp_path / "s")
    assert after.keys() == [] and verify(after).ok and not list(after.blobs_dir.rglob("*/*"))


def test_a_lookup_by_probe_reads_an_index_not_every_entry(tmp_path) -> None:
    """``entry_rows(probe)`` answers from an index on the probe column (sqlite's query plan
    says so), with 5,000 other entries in the store; a store made before the column gets it,
    filled from each row's metadata, when it is next opened for writing."""
    import sqlite3

    from aotc.cache import Store

    s = Store(tmp_path / "store")
    s.put("a" * 64, "wanted", {"program": b"p"}, metadata={"probe": "p" * 64})
    with s.index.write() as conn:  # 5,000 entries of another probe, written in one go
        conn.executemany("INSERT INTO entries (key, name, factors, metadata, created, last_used, "
                         "probe) VALUES (?, 'other', '{}', ?, 0, 0, ?)",
                         [(f"{i:064x}", '{"probe": "%s"}' % ("q" * 64), "q" * 64) for i in range(5000)])
    rows = s.entry_rows("p" * 64)
    assert [r["key"] for r in rows] == ["a" * 64]
    plan = " ".join(str(r) for r in s.index.conn.execute(
        "EXPLAIN QUERY PLAN SELECT key FROM entries WHERE probe = ?", ("p" * 64,)))
    assert "idx_entries_probe" in plan, plan
    path = s.index.path
    s.close()
    # an index from before the column: dropped here, then the store is opened again
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX idx_entries_probe")
    conn.execute("ALTER TABLE entries DROP COLUMN probe")
    conn.execute("UPDATE entries SET metadata = 'not json' WHERE key = ?", ("0" * 64,))
    conn.commit()
    conn.close()
    again = Store(tmp_path / "store")
    try:
        assert [r["key"] for r in again.entry_rows("p" * 64)] == ["a" * 64]
        assert len(again.entry_rows("q" * 64)) == 4999  # the garbage row is never a candidate
    finally:
        again.close()


def test_an_entry_counts_each_blob_once_and_says_what_it_shares(store: Store) -> None:
    """Two roles naming one blob (batched kernel libraries) count once: no entry is ever larger
    than the store; a blob another entry holds too is said as shared."""
    store.put(key("a"), "a", {"k1": b"same", "k2": b"same", "own": b"xyz"})
    store.put(key("b"), "b", {"k": b"same"})
    s = scan(store)
    a = next(e for e in s.entries if e.name == "a")
    assert (a.blob_count, a.size, a.shared_blobs) == (2, 7, 1)
    assert a.stored_size <= s.size_on_disk and a.shared_stored_size > 0
    assert s.to_json()["entries"][0]["shared_blobs"] == 1
