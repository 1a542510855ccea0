"""A store that bounds itself (``AOTC_MAX_SIZE`` / ``aotc --max-size``): after a put the least
recently used entries are evicted until the store fits — never the entry just put, one used in
the last ``min_idle`` seconds, or one a running process holds (``locks.hold``). No compiles here:
small byte blobs through ``Store.put``."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from aotc.cache import Store, bound, locks, plan_gc, scan, unpacked
from aotc.cache.locks import FileLock, lock_path
from aotc.cli import cli
from aotc.errors import SettingsError
from aotc.lookup.stores import open_store
from aotc.settings import Settings
from tests.conftest import PYTHON, python_env

BLOB = 100_000  # random bytes: stored (zstd) at about this size


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _put(store: Store, name: str, age: float | None = None) -> str:
    """Put entry ``name`` (one random blob); with ``age``, make it last used ``age`` seconds ago."""
    k = store.put(key(name), name, {"x": os.urandom(BLOB)}).key
    if age is not None:
        _backdate(store, k, age)
    return k


def _backdate(store: Store, k: str, age: float) -> None:
    with sqlite3.connect(store.index_path) as conn:
        conn.execute("UPDATE entries SET created = ?, last_used = ? WHERE key = ?",
                     (time.time() - age, time.time() - age, k))


def _names(store: Store) -> list[str]:
    return sorted(r["name"] for r in store.index.query("SELECT name FROM entries"))


def test_puts_past_the_bound_evict_the_least_recently_used(tmp_path: Path) -> None:
    limit = int(2.5 * BLOB)
    store = Store(tmp_path / "s", max_size=limit)
    for i in range(5):  # each one idle for a while once put: e0 the least recently used
        _put(store, f"e{i}", age=1000 - 100 * i)
        assert bound.used_size(store) <= limit
    assert _names(store) == ["e3", "e4"]  # the newest stay
    assert scan(store).size_on_disk <= limit


def test_just_put_and_recently_used_entries_keep_the_store_over(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", max_size=BLOB)
    a = _put(store, "a")
    _put(store, "b")  # over, but a was written a moment ago (min_idle) and b is the one just put
    assert _names(store) == ["a", "b"] and bound.used_size(store) > BLOB
    _backdate(store, a, 3600)
    _put(store, "c")  # a is idle now: evicted; b is still fresh
    assert _names(store) == ["b", "c"]


def test_a_get_makes_an_entry_the_most_recently_used(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")  # no bound yet: nothing evicted while filling
    a, b = _put(store, "a", age=3000), _put(store, "b", age=2000)
    c = _put(store, "c", age=1000)
    store.get(a)  # a served again: now the most recently used
    store.max_size = 2 * BLOB + 1000
    freed = bound.evict_to_bound(store, keep=c, min_idle=0)  # no grace: the order alone decides
    assert freed >= BLOB and _names(store) == ["a", "c"]
    assert not store.has(b)


def test_under_the_bound_a_put_only_asks_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "s", max_size=10 * BLOB)

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("planned an eviction under the bound")

    monkeypatch.setattr(bound, "plan_gc", boom)
    for i in range(3):
        _put(store, f"e{i}", age=1000)
    assert len(_names(store)) == 3


_HOLDER = """
import sys, time
from pathlib import Path
from aotc.cache.locks import hold
assert hold(Path(sys.argv[1]), sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


def test_an_entry_another_process_holds_is_not_evicted_until_it_exits(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", max_size=int(2.5 * BLOB))
    a, b = _put(store, "a", age=3000), _put(store, "b", age=2000)
    proc = subprocess.Popen([PYTHON, "-c", _HOLDER, str(store.base), a], stdout=subprocess.PIPE,
                            text=True, env=python_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert locks.is_held(store.base, a)
        plan = plan_gc(store, max_size=0, min_idle=0)  # what `aotc gc` would say: a is spared
        assert a in [e.key for e in plan.protected] and a not in [e.key for e in plan.entries]
        c = _put(store, "c")  # over: a is the least recently used but held, so b goes
        assert _names(store) == ["a", "c"]
        _backdate(store, c, 1000)
    finally:
        proc.kill()
        proc.wait()
    assert not locks.is_held(store.base, a)
    _put(store, "d")  # the holder is gone: a (least recently used) can go now, with its lock file
    assert _names(store) == ["c", "d"]
    assert not lock_path(store.base, "hold", a).exists()
    assert not store.has(b)


def test_an_unpacked_entry_is_held_by_its_process(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    a = _put(store, "a", age=3000)
    with unpacked.unpack(store, store.get(a, record=False), {"x": "x.so"}):
        pass
    assert locks.is_held(store.base, a)  # after the load too: the process may still read it
    assert plan_gc(store, max_size=0, min_idle=0).entries == ()
    locks.release_hold(store.base, a)
    assert [e.key for e in plan_gc(store, max_size=0, min_idle=0).entries] == [a]


def test_gc_removes_the_lock_files_of_gone_entries_nobody_holds(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    a = _put(store, "a")
    gone, busy = key("gone"), key("busy")
    for k in (a, gone):  # lock files left by processes that have let go
        left = FileLock(lock_path(store.base, "hold", k))
        assert left.acquire()
        left.release()
    assert locks.hold(store.base, busy)  # an entry gone from the index that this process holds
    plan = plan_gc(store)
    assert sorted(plan.stale_locks) == sorted([f"hold-{gone}", f"hold-{busy}"])
    plan.execute()
    assert sorted(p.name for p in (store.base / "locks").iterdir()) == sorted([f"hold-{a}", f"hold-{busy}"])
    locks.release_hold(store.base, busy)


def test_a_lock_removed_while_waited_for_is_taken_on_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "hold-x"
    first = FileLock(path)
    assert first.acquire()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(FileLock(path, shared=True).acquire(timeout=5)))
    waiter.start()
    time.sleep(0.2)
    path.unlink()  # the remover holds it exclusively, removes it, lets go
    first.release()
    waiter.join()
    assert got == [True] and path.exists()  # locked the file the path names now
    assert not FileLock(path).acquire(timeout=0)  # ... which an exclusive taker sees as held


def test_settings_and_open_store_carry_the_bound(tmp_path: Path) -> None:
    assert Settings.from_env({}).max_size is None
    assert Settings.from_env({"AOTC_MAX_SIZE": "1.5G"}).max_size == 3 << 29
    with pytest.raises(SettingsError, match="AOTC_MAX_SIZE='bad'.*10G"):
        Settings.from_env({"AOTC_MAX_SIZE": "bad"})
    opened = open_store(tmp_path / "s", create=True, settings=Settings.from_env({"AOTC_MAX_SIZE": "1M"}))
    assert opened.max_size == 1 << 20


def test_bad_aotc_max_size_is_a_one_line_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["--store", str(tmp_path), "inspect", "cache"],
                             env={"AOTC_MAX_SIZE": "bad"})
    assert res.exit_code == 2
    assert res.output.strip().count("\n") == 0 and "AOTC_MAX_SIZE='bad'" in res.output
    res = CliRunner().invoke(cli, ["--max-size", "lots", "--store", str(tmp_path), "inspect", "cache"])
    assert res.exit_code == 2 and "--max-size" in res.output


def test_inspect_cache_shows_the_bound(tmp_path: Path) -> None:
    store = Store(tmp_path)
    _put(store, "a")

    def inspect(*opts: str, env: dict[str, str | None] | None = None) -> dict:
        res = CliRunner().invoke(cli, [*opts, "--store", str(tmp_path), "inspect", "cache", "--json"],
                                 env=env or {"AOTC_MAX_SIZE": None})
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    out = inspect("--max-size", "2G", env={"AOTC_MAX_SIZE": "1G"})  # the option wins
    assert out["max_size"] == 2 << 30 and out["max_size_source"] == "--max-size"
    assert out["size_used"] == out["size_on_disk"] >= BLOB
    out = inspect(env={"AOTC_MAX_SIZE": "1G"})
    assert out["max_size"] == 1 << 30 and out["max_size_source"] == "AOTC_MAX_SIZE"
    out = inspect()
    assert out["max_size"] is None and out["max_size_source"] is None
    res = CliRunner().invoke(cli, ["--max-size", "2G", "--store", str(tmp_path), "inspect", "cache"])
    assert "max size: 2.0G (--max-size), " in res.output
    res = CliRunner().invoke(cli, ["--store", str(tmp_path), "inspect", "cache"], env={"AOTC_MAX_SIZE": None})
    assert "max size: none, " in res.output


def test_the_cli_bound_applies_to_puts_and_gc(tmp_path: Path) -> None:
    store = Store(tmp_path)
    a = _put(store, "a", age=3000)
    _put(store, "b", age=2000)
    res = CliRunner().invoke(cli, ["--max-size", str(BLOB + 1000), "--store", str(tmp_path), "gc"])
    assert res.exit_code == 0, res.output
    assert _names(store) == ["b"] and not store.has(a)
