"""A separate process that uses a store, for crash and concurrency tests.

    python store_worker.py crash STORE POINT     put one entry and SIGKILL itself at POINT
    python store_worker.py write STORE ID N      put N entries that share blobs with other writers
    python store_worker.py read  STORE N         read every entry it sees, N rounds, verify bytes

Crash points are injected here, in the test process only, by wrapping the functions a put calls;
the store's own code has no test hooks.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

from aotc.cache import Store
from aotc.cache import blobio
from aotc.cache import store as store_mod


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def payload(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def entry_key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def crash(root: str, point: str) -> None:
    store = Store(root)
    blobs = {"a": payload("a", 3 << 20), "b": payload("b", 1 << 20), "c": os.urandom(2 << 20)}
    if point == "mid-stage":  # the staging file is half written
        real = blobio.stage_blob
        calls = {"n": 0}

        def stage(source, staging_dir, level=3):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 2:
                import zstandard
                path = staging_dir / "blob-partial.zst"
                with open(path, "wb") as f:
                    f.write(zstandard.ZstdCompressor().compress(bytes(source))[:1000])
                    f.flush()
                    os.fsync(f.fileno())
                die()
            return real(source, staging_dir, level)

        store_mod.blobio.stage_blob = stage  # type: ignore[assignment]
    elif point in ("after-first-rename", "before-index"):
        real_replace = os.replace
        calls = {"n": 0}

        def replace(src, dst):  # type: ignore[no-untyped-def]
            real_replace(src, dst)
            calls["n"] += 1
            if point == "after-first-rename" or calls["n"] == len(blobs):
                die()

        store_mod.os.replace = replace  # type: ignore[assignment]
    elif point == "in-transaction":
        index = store.index
        conn = index.conn

        class Proxy:
            def execute(self, sql, params=()):  # type: ignore[no-untyped-def]
                if sql.startswith("INSERT OR REPLACE INTO entries"):
                    conn.execute(sql, params)
                    die()
                return conn.execute(sql, params)

            def __getattr__(self, name):  # type: ignore[no-untyped-def]
                return getattr(conn, name)

        index._local.conn = Proxy()
    else:
        raise SystemExit(f"unknown point {point}")
    store.put(entry_key("crash"), "crash", blobs, factors={"x": 1})
    raise SystemExit("survived: crash point never reached")


def write(root: str, ident: str, count: int) -> None:
    store = Store(root)
    for i in range(count):
        shared = payload(f"shared-{i % 3}", 256 << 10)
        own = payload(f"own-{ident}-{i}", 64 << 10)
        # entries overlap across writers: the same key is written by every writer
        key = entry_key(f"entry-{i}")
        store.put(key, f"entry-{i}", {"shared": shared, "own": payload(f"own-{i}", 64 << 10)},
                  metadata={"writer": ident})
        store.put(entry_key(f"w{ident}-{i}"), f"w{ident}-{i}", {"shared": shared, "own": own})
    print("ok")


def read(root: str, rounds: int) -> None:
    store = Store(root)
    seen = 0
    for _ in range(rounds):
        for key in store.keys():
            try:
                entry = store.get(key)
            except Exception as exc:  # a concurrent replace may race the row read
                if type(exc).__name__ == "CacheMiss":
                    continue
                raise
            for role in entry.blobs:
                data = store.read_blob(entry, role)
                if hashlib.sha256(data).hexdigest() != entry.blobs[role].digest:
                    raise SystemExit("wrong bytes")
                seen += 1
        time.sleep(0.01)
    print(f"ok {seen}")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "crash":
        crash(sys.argv[2], sys.argv[3])
    elif mode == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "read":
        read(sys.argv[2], int(sys.argv[3]))
