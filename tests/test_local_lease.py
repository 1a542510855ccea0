"""One compile per node: processes sharing one local store (no remote) build a missing key once
(:mod:`aotc.fleet.local_lease`, through :meth:`aotc.fleet.tiered.TieredStore.get_or_build`).

Real processes and real locks: the fast tests contend with a cheap ``build`` that stores a tiny
entry and counts itself in a file; the slow one runs three fresh ``torch.compile(backend="aotc")``
processes against one empty store and counts Inductor's compiles in each."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from aotc.cache import Store, StoreReadOnlyError
from aotc.fleet.tiered import TieredStore, Wanted
from aotc.progress import Progress
from tests.conftest import PYTHON, python_env

WAITING = "waiting for another process on this node compiling"

# argv: store, key, count file, seconds the build takes, ready file, go file, how the build ends
_CHILD = """
import json, os, sys, time
from aotc.cache import Store
from aotc.fleet.tiered import TieredStore, Wanted
from aotc.progress import Progress
root, key, count, seconds, ready, go, end = sys.argv[1:8]
tiered = TieredStore(Store(root), progress=Progress(stream=sys.stderr))

def build():
    with open(count, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if end == "fail":  # the backend's way: the failure is remembered, then raised
        from aotc.backend.given_up import failure_version
        from aotc.cache import failures
        failures.remember(tiered.local, key, "tiny", failure_version(None), "cannot split", failures.REPEATS)
    open(ready + ".building", "w").close()
    time.sleep(float(seconds))
    if end == "fail":
        raise RuntimeError("the compile failed")
    return tiered.put(key, "tiny", {"program": b"{}"}, {"a": 1}, {})

open(ready, "w").close()
while go != "-" and not os.path.exists(go):
    time.sleep(0.005)
served = tiered.get_or_build(Wanted.by_key(key, "tiny"), build)
print(json.dumps({"built": served.built is not None, "key": (served.entry or served.built).key}))
"""


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _child(store: Path, key: str, count: Path, seconds: float, ready: Path, go: Path | None,
           end: str = "store") -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-c", _CHILD, str(store), key, str(count), str(seconds), str(ready),
                             str(go) if go else "-", end],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _builds(count: Path) -> list[str]:
    return count.read_text().split() if count.exists() else []


def _tiny_build(tiered: TieredStore, key: str, count: Path):  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        with count.open("a") as f:
            f.write(f"{os.getpid()}-{threading.get_ident()}\n")
        return tiered.put(key, "tiny", {"program": b"{}"}, {"a": 1}, {})
    return build


def test_three_processes_at_once_build_once_and_the_others_are_served(tmp_path: Path) -> None:
    store, key, count, go = tmp_path / "store", _key("three"), tmp_path / "builds", tmp_path / "go"
    Store(store).close()
    procs = [_child(store, key, count, 2.0, tmp_path / f"ready{i}", go) for i in range(3)]
    for i in range(3):
        _wait_for(tmp_path / f"ready{i}")
    go.touch()  # all three miss at once
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _o, e in outs]
    results = [json.loads(o) for o, _e in outs]
    assert len(_builds(count)) == 1  # exactly one build on this node
    assert sorted(r["built"] for r in results) == [False, False, True]  # the others were served it
    assert {r["key"] for r in results} == {key}
    waited = [e for (_o, e), r in zip(outs, results) if not r["built"]]
    assert all(WAITING in e and f"locks/build-{key}" in e for e in waited), waited
    assert (store / "store-v1" / "locks" / f"build-{key}").is_file()  # left in place, empty


def test_a_holder_killed_mid_build_leaves_the_lease_to_a_waiter(tmp_path: Path) -> None:
    store, key, count = tmp_path / "store", _key("killed"), tmp_path / "builds"
    Store(store).close()
    holder = _child(store, key, count, 120, tmp_path / "ready", None)
    _wait_for(tmp_path / "ready.building")  # it holds the lease and builds
    tiered = TieredStore(Store(store), progress=Progress(stream=(said := io.StringIO())), lease_wait=60)
    served: list = []
    waiter = threading.Thread(target=lambda: served.append(
        tiered.get_or_build(Wanted.by_key(key, "tiny"), _tiny_build(tiered, key, count))))
    waiter.start()
    deadline = time.monotonic() + 30
    while WAITING not in said.getvalue():
        assert time.monotonic() < deadline and waiter.is_alive(), "the waiter never waited"
        time.sleep(0.01)
    holder.send_signal(signal.SIGKILL)  # mid-build: nothing stored, the kernel drops its lock
    t = time.monotonic()
    holder.wait(timeout=30)
    waiter.join(timeout=30)
    took = time.monotonic() - t
    assert not waiter.is_alive() and served and served[0].built is not None and served[0].built.key == key
    assert len(_builds(count)) == 2 and took < 10  # the holder's (killed) and the waiter's own
    assert tiered.local.has(key)


def test_a_waiter_past_its_bound_builds_itself(tmp_path: Path, caplog) -> None:
    store, key, count = tmp_path / "store", _key("bound"), tmp_path / "builds"
    Store(store).close()
    holder = _child(store, key, count, 120, tmp_path / "ready", None)
    try:
        _wait_for(tmp_path / "ready.building")
        tiered = TieredStore(Store(store), progress=Progress(quiet=True), lease_wait=0.3)
        t = time.monotonic()
        served = tiered.get_or_build(Wanted.by_key(key, "tiny"), _tiny_build(tiered, key, count))
        assert served.built is not None and time.monotonic() - t < 10
        assert any("compiling here" in r.getMessage() for r in caplog.records)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_waiter_finding_a_recorded_failure_reads_it_and_does_not_build_again(tmp_path: Path) -> None:
    """The holder remembers the failure (as the backend does) and fails; the waiter then runs its
    caller's own path, which reads the failure and gives up at once: no second build, no loop."""
    from aotc.backend.given_up import GivenUpBefore, raise_if_given_up

    store, key, count = tmp_path / "store", _key("failed"), tmp_path / "builds"
    Store(store).close()
    holder = _child(store, key, count, 1.0, tmp_path / "ready", None, end="fail")
    _wait_for(tmp_path / "ready.building")
    tiered = TieredStore(Store(store), progress=Progress(stream=(said := io.StringIO())), lease_wait=60)
    inner = _tiny_build(tiered, key, count)
    calls: list[int] = []

    def build():  # type: ignore[no-untyped-def]
        calls.append(1)
        raise_if_given_up(tiered.local, key)
        return inner()

    with pytest.raises(GivenUpBefore, match="cannot split"):
        tiered.get_or_build(Wanted.by_key(key, "tiny"), build)
    _out, err = holder.communicate(timeout=30)
    assert holder.returncode != 0 and "the compile failed" in err
    assert WAITING in said.getvalue() and calls == [1] and len(_builds(count)) == 1


def test_a_read_only_store_takes_no_lease(tmp_path: Path) -> None:
    """On a real read-only bind mount: an entry there is served, a missing one is built as
    before (its put raises ``StoreReadOnlyError``), and no lock file is made."""
    from tests.test_serving import _read_only_mount_works

    why = _read_only_mount_works()
    if why:
        pytest.skip(why)
    src, mnt, have, missing = tmp_path / "store", tmp_path / "mnt", _key("here"), _key("missing")
    s = Store(src)
    s.put(have, "tiny", {"program": b"{}"}, factors={"a": 1})
    s.close()
    mnt.mkdir()
    code = ("import sys; from aotc.cache import Store, StoreReadOnlyError; "
            "from aotc.fleet.tiered import TieredStore, Wanted; "
            "t = TieredStore(Store(sys.argv[1], create=False)); print(t.local.read_only); "
            "print(t.get_or_build(Wanted.by_key(sys.argv[2]), None).entry.key == sys.argv[2]); "
            "build = lambda: t.put(sys.argv[3], 'tiny', {'program': b'{}'}, {'a': 1}, {})\n"
            "try:\n  t.get_or_build(Wanted.by_key(sys.argv[3]), build)\n"
            "except StoreReadOnlyError as e:\n  print('read-only:', e)")
    script = " && ".join(["mount --make-rprivate /", f"mount --bind {src} {mnt}",
                          f"mount -o remount,bind,ro {mnt}",
                          f"{PYTHON} -c \"$CODE\" {mnt} {have} {missing}"])
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         env={**python_env(), "CODE": code}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == ["True", "True"] and lines[2].startswith("read-only:"), out.stdout
    assert "build lease" not in out.stderr and not (src / "store-v1" / "locks").exists()


def test_a_read_only_store_object_builds_as_before(tmp_path: Path) -> None:
    """The same where no mount namespace is at hand: a store opened read-only has no lease."""
    s = Store(tmp_path / "store")
    s.read_only = True  # what a store on a read-only volume is opened as
    tiered = TieredStore(s)
    with pytest.raises(StoreReadOnlyError):
        tiered.get_or_build(Wanted.by_key(_key("ro")), lambda: tiered.put(_key("ro"), "t", {"p": b"1"}, {}, {}))
    assert not (tmp_path / "store" / "store-v1" / "locks").exists()


# -- three fresh torch.compile(backend="aotc") processes, one empty store ----------------------

_BACKEND_CHILD = """
import json, os, sys, time
import torch, aotc
from aotc._torch.inductor_facts import counters_snapshot
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
x = torch.randn(4, 16)
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.005)
t = time.perf_counter()
with torch.no_grad():
    out = torch.compile(model, backend="aotc")(x)
    seconds = time.perf_counter() - t
    eager = model(x)
print(json.dumps({"ok": torch.allclose(out, eager, atol=1e-5), "out": out.tolist(),
                  "seconds": round(seconds, 2), "counters": counters_snapshot()}))
"""


@pytest.mark.slow
def test_three_backend_processes_on_one_store_compile_once(tmp_path: Path) -> None:
    store, go, report = tmp_path / "store", tmp_path / "go", tmp_path / "report.jsonl"
    procs = []
    for i in range(3):
        d = tmp_path / f"p{i}"
        d.mkdir()
        env = {**python_env(), "AOTC_STORE": str(store), "AOTC_FALLBACK": "error",
               "AOTC_REPORT": str(report), "AOTC_LOG": "info", "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
               "TMPDIR": str(d)}
        env.pop("AOTC_REMOTE", None)
        procs.append(subprocess.Popen([PYTHON, "-c", _BACKEND_CHILD, str(d / "ready"), str(go)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for i in range(3):
        _wait_for(tmp_path / f"p{i}" / "ready", 300)
    t = time.monotonic()
    go.touch()  # all three miss at once
    outs = [p.communicate(timeout=600) for p in procs]
    wall = time.monotonic() - t
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-3000:] for _o, e in outs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _e in outs]
    assert all(r["ok"] for r in results) and len({json.dumps(r["out"]) for r in results}) == 1
    inductor = [r["counters"]["inductor_compiles"] for r in results]
    aotc_compiles = [r["counters"]["compiles"] for r in results]
    print(f"three processes, one store: wall {wall:.1f}s after go; seconds per process "
          f"{[r['seconds'] for r in results]}; Inductor compiles {inductor}; aotc compiles {aotc_compiles}")
    assert sorted(inductor)[:2] == [0, 0] and max(inductor) > 0  # one process compiled, alone
    assert sorted(aotc_compiles)[:2] == [0, 0] and max(aotc_compiles) > 0
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert sorted(x["hit"] for x in lines) == [False, True, True] and len({x["key"] for x in lines}) == 1
    assert sum(WAITING in e for _o, e in outs) >= 1
