"""Compile leases in the remote (:mod:`aotc.fleet.lease`) against the real S3 test server (moto's,
on loopback): the lease logic in-process with plain callables, then real ``aotc compile``
processes — 4 replicas with empty stores at once compile once; the leaseholder SIGKILLed
mid-compile is taken over after its lease expires and every process finishes."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from aotc.cache import Store
from aotc.fleet.lease import LeaseInfo, conditional_writes, single_flight
from aotc.fleet.remote import S3Remote
from tests.conftest import AOTC_CLI, PYTHON, python_env, tiny_manifest


def _remote(s3) -> S3Remote:  # type: ignore[no-untyped-def]
    return S3Remote(f"s3://{s3()}/fleet", s3.endpoint)


def test_the_test_server_honours_conditional_writes(s3) -> None:
    remote = _remote(s3)
    assert conditional_writes(remote)
    assert remote.put("x", b"1", if_absent=True, strict=True) is True
    assert remote.put("x", b"2", if_absent=True, strict=True) is False
    assert remote.get_bytes("x") == b"1" and list(remote.list("lease-probes/")) == []  # probe gone


def test_a_remote_that_cannot_be_written_means_no_leases_not_a_failure(s3, caplog) -> None:
    """Read-only credentials (here: a bucket that does not exist) never fail a start: no
    leases, said once, and the caller builds."""
    s3()  # the server runs
    remote = S3Remote("s3://no-such-bucket-for-leases/x", s3.endpoint)
    assert not conditional_writes(remote)
    assert single_flight(remote, "k0", "toy", lambda: None, lambda: "built", 10, 10) == "built"
    lines = [r.getMessage() for r in caplog.records if "no compile leases" in r.getMessage()]
    assert len(lines) == 1 and "cannot be written" in lines[0]


def test_concurrent_misses_build_once_and_the_others_fetch(s3) -> None:
    remote = _remote(s3)
    stored: list[str] = []
    builds: list[int] = []
    results: list[str] = []

    def fetch() -> str | None:
        return stored[0] if stored else None

    def build() -> str:
        builds.append(1)
        time.sleep(1.5)  # a compile
        stored.append("entry")
        return "built"

    threads = [threading.Thread(target=lambda: results.append(
        single_flight(remote, "k1", "toy", fetch, build, ttl=10, max_wait=60, poll=0.1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [1] and sorted(results) == ["built", "entry", "entry", "entry"]
    assert list(remote.list("leases/")) == []  # released


def test_a_waiter_never_waits_past_its_bound(s3, caplog) -> None:
    remote = _remote(s3)
    alive = LeaseInfo("other-host:42:abcd", time.time(), time.time() + 3600, "toy")
    remote.put("leases/k2.json", alive.to_bytes())  # held by a live process that never finishes
    t = time.monotonic()
    got = single_flight(remote, "k2", "toy", lambda: None, lambda: "mine", ttl=10, max_wait=1.5, poll=0.2)
    waited = time.monotonic() - t
    assert got == "mine" and 1.5 <= waited < 5
    assert any("waited 2s for other-host:42:abcd" in r.getMessage() for r in caplog.records)
    assert LeaseInfo.parse(remote.get_bytes("leases/k2.json")) == alive  # never touched another's


def test_an_expired_lease_is_taken_over(s3, caplog) -> None:
    remote = _remote(s3)
    dead = LeaseInfo("gone:1:dead", time.time() - 100, time.time() - 1, "toy")
    remote.put("leases/k3.json", dead.to_bytes())
    t = time.monotonic()
    assert single_flight(remote, "k3", "toy", lambda: None, lambda: "mine", ttl=10, max_wait=60) == "mine"
    assert time.monotonic() - t < 5
    assert any("expired" in r.getMessage() and "taking it over" in r.getMessage() for r in caplog.records)
    assert remote.get_bytes("leases/k3.json") is None


def test_the_heartbeat_keeps_a_long_compile_s_lease_alive(s3) -> None:
    remote = _remote(s3)
    seen: list[tuple[float, LeaseInfo | None]] = []

    def build() -> str:
        for _ in range(3):  # 3 TTLs of work: without renewal the lease would expire twice over
            time.sleep(1.0)
            seen.append((time.time(), LeaseInfo.parse(remote.get_bytes("leases/k4.json"))))
        return "built"

    assert single_flight(remote, "k4", "toy", lambda: None, build, ttl=1.0, max_wait=60) == "built"
    assert all(info is not None and info.expires > when for when, info in seen)  # never expired
    first, last = seen[0][1], seen[-1][1]
    assert first is not None and last is not None and last.expires > first.expires


class _Faulty(S3Remote):
    """The real S3 remote with one kind of trouble on the lease prefix (what a busy bucket or a
    narrow IAM role does): ``fail`` — every lease call raises as a 503 SlowDown would;
    ``lose_answer`` — a create reaches the bucket but its answer is lost (the client's retry is
    refused: False); ``no_delete`` — deletes under leases/ are silently dropped."""

    def __init__(self, s3, url: str, fault: str) -> None:  # type: ignore[no-untyped-def]
        super().__init__(url, s3.endpoint)
        self.fault = fault

    def _ours(self, name: str) -> bool:
        return name.startswith(("leases/", "lease-probes/"))

    def get_bytes(self, name: str, *a, **kw):  # type: ignore[no-untyped-def, override]
        if self.fault == "fail" and name.startswith("leases/"):
            from aotc.errors import RemoteError

            raise RemoteError(f"GET {name} failed: SlowDown (503)")
        return super().get_bytes(name, *a, **kw)

    def get_tagged(self, name: str, *a, **kw):  # type: ignore[no-untyped-def, override]
        self.get_bytes(name)  # the same trouble
        return super().get_tagged(name, *a, **kw)

    def put(self, name: str, body, if_absent: bool = False, strict: bool = False):  # type: ignore[no-untyped-def, override]
        done = super().put(name, body, if_absent=if_absent, strict=strict)
        if self.fault == "lose_answer" and if_absent and name.startswith("leases/"):
            return False
        return done

    def put_tagged(self, name: str, body: bytes, if_match=None, if_absent: bool = False):  # type: ignore[no-untyped-def, override]
        done = super().put_tagged(name, body, if_match=if_match, if_absent=if_absent)
        if self.fault == "lose_answer" and name.startswith("leases/"):
            return None  # written, but the answer lost: the client's retry was refused
        return done

    def _deleting(self, name: str) -> bool:
        if self.fault == "no_delete" and name.startswith("leases/"):
            return False
        if self.fault == "deny_delete" and self._ours(name):
            from aotc.errors import RemoteError

            raise RemoteError(f"DELETE {name}: AccessDenied")
        return True

    def delete(self, name: str) -> None:
        if self._deleting(name):
            super().delete(name)

    def delete_if_match(self, name: str, etag: str) -> bool:
        return super().delete_if_match(name, etag) if self._deleting(name) else True


def test_a_lease_the_remote_fails_means_compiling_here_not_a_failed_call(s3, caplog) -> None:
    remote = _Faulty(s3, f"s3://{s3()}/fleet", "fail")
    alive = LeaseInfo("other-host:42:abcd", time.time(), time.time() + 3600, "toy")
    S3Remote(remote.url, s3.endpoint).put("leases/k5.json", alive.to_bytes())
    got = single_flight(remote, "k5", "toy", lambda: None, lambda: "mine", ttl=10, max_wait=60, poll=0.1)
    assert got == "mine"
    assert any("compile lease for toy" in r.getMessage() and "compiling here" in r.getMessage()
               for r in caplog.records)


def test_a_create_whose_answer_was_lost_is_still_ours(s3) -> None:
    remote = _Faulty(s3, f"s3://{s3()}/fleet", "lose_answer")
    t = time.monotonic()
    assert single_flight(remote, "k6", "toy", lambda: None, lambda: "mine", ttl=10, max_wait=60) == "mine"
    assert time.monotonic() - t < 5  # never waited on its own lease
    assert list(remote.list("leases/")) == []  # and released it


def test_a_lease_that_cannot_be_removed_never_holds_a_waiter_past_its_bound(s3) -> None:
    remote = _Faulty(s3, f"s3://{s3()}/fleet", "no_delete")
    dead = LeaseInfo("gone:1:dead", time.time() - 100, time.time() - 1, "toy")
    remote.put("leases/k7.json", dead.to_bytes())
    t = time.monotonic()
    assert single_flight(remote, "k7", "toy", lambda: None, lambda: "mine", ttl=10, max_wait=1.0,
                         poll=0.1) == "mine"
    assert time.monotonic() - t < 10


def test_credentials_that_cannot_delete_mean_no_leases_asked_again_later(s3, caplog, monkeypatch) -> None:
    from aotc.fleet import lease

    remote = _Faulty(s3, f"s3://{s3()}/fleet", "deny_delete")
    assert not conditional_writes(remote)
    assert any("no compile leases" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(lease, "_RETRY_PROBE", 0.0)
    lease._SUPPORT.pop(remote.url)
    assert not conditional_writes(remote)  # asked again (the answer held for 0 s) …
    remote.fault = ""
    assert conditional_writes(remote)  # … and once the remote allows it, leases are on


def _compile_proc(manifest: Path, store: Path, url: str, tmp: Path, name: str,
                  **env: str) -> subprocess.Popen:
    d = tmp / name
    d.mkdir()
    full = {**python_env(), "AOTC_REMOTE": url, "AOTC_ALLOW_UNSIGNED": "1", "AOTC_LOG": "info",
            "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TMPDIR": str(d), **env}
    return subprocess.Popen([*AOTC_CLI, "--store", str(store), "compile", str(manifest), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


@pytest.mark.slow
def test_four_replicas_at_once_compile_once(s3, tmp_path: Path) -> None:
    manifest = tiny_manifest(tmp_path)
    url = f"s3://{s3()}/fleet"
    procs = [_compile_proc(manifest, tmp_path / f"store{i}", url, tmp_path, f"p{i}") for i in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-2000:] for _o, e in outs]
    results = [json.loads(o) for o, _e in outs]
    print("replicas:", [(r["hit"], r["compiles"], round(r["seconds"].get("pull", 0), 2)) for r in results])
    assert sorted(r["hit"] for r in results) == [False, True, True, True]
    builder = next(r for r in results if not r["hit"])
    assert builder["compiles"] > 0 and sum(r["compiles"] for r in results) == builder["compiles"]
    assert len({r["key"] for r in results}) == 1
    digests = [{b.digest for b in Store(tmp_path / f"store{i}").get(results[0]["key"]).blobs.values()}
               for i in range(4)]
    assert all(d == digests[0] for d in digests)  # identical results everywhere
    waited = [e for _o, e in outs if "is compiling toy-tiny since" in e]
    assert len(waited) >= 1  # the others said who holds the lease


@pytest.mark.slow
def test_a_killed_leaseholder_is_taken_over_and_all_finish(s3, tmp_path: Path) -> None:
    manifest = tiny_manifest(tmp_path)
    url = f"s3://{s3()}/fleet"
    remote = S3Remote(url, s3.endpoint)
    ttl = {"AOTC_LEASE_TTL": "3"}
    holder = _compile_proc(manifest, tmp_path / "s0", url, tmp_path, "p0", **ttl)
    deadline = time.monotonic() + 120
    while not list(remote.list("leases/")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(remote.list("leases/")), "the first process never took the lease"
    waiters = [_compile_proc(manifest, tmp_path / f"s{i}", url, tmp_path, f"p{i}", **ttl) for i in (1, 2)]
    time.sleep(2)
    holder.send_signal(signal.SIGKILL)  # mid-compile: its lease stays behind, unrenewed
    holder.wait(timeout=30)
    t = time.monotonic()
    outs = [p.communicate(timeout=600) for p in waiters]
    assert [p.returncode for p in waiters] == [0, 0], [e[-2000:] for _o, e in outs]
    results = [json.loads(o) for o, _e in outs]
    print(f"after the kill: {time.monotonic() - t:.1f}s; waiters (hit, compiles):",
          [(r["hit"], r["compiles"]) for r in results])
    assert sorted(r["hit"] for r in results) == [False, True]  # one took over, the other pulled
    assert results[0]["key"] == results[1]["key"]
    assert any("expired" in e and "taking it over" in e for _o, e in outs)
    assert list(remote.list("leases/")) == []


_BACKEND_CHILD = """
import torch, aotc
def fn(x):
    return torch.nn.functional.gelu(x @ x.T) * 3 + 1
x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48
out = torch.compile(fn, backend="aotc")(x)
assert torch.allclose(out, fn(x), atol=1e-5)
print(out.sum().item())
"""


@pytest.mark.slow
def test_three_backend_processes_at_once_compile_a_graph_once(s3, tmp_path: Path) -> None:
    url = f"s3://{s3()}/graphs"
    report = tmp_path / "report.jsonl"
    procs = []
    for i in range(3):
        d = tmp_path / f"b{i}"
        d.mkdir()
        env = {**python_env(), "AOTC_STORE": str(d / "store"), "AOTC_REMOTE": url,
               "AOTC_ALLOW_UNSIGNED": "1", "AOTC_REPORT": str(report), "AOTC_FALLBACK": "error",
               "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TMPDIR": str(d)}
        procs.append(subprocess.Popen([PYTHON, "-c", _BACKEND_CHILD],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _o, e in outs]
    assert len({o.strip() for o, _e in outs}) == 1  # the same answer everywhere
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert sorted(x["hit"] for x in lines) == [False, True, True]  # one compiled, two pulled it
    assert all(x["pulled"] for x in lines if x["hit"]) and len({x["key"] for x in lines}) == 1


@pytest.mark.slow
def test_a_load_waits_for_a_compile_in_flight_then_pulls_it(compiled, s3, tmp_path: Path,
                                                             monkeypatch) -> None:
    """``aotc.load`` with pull-through of an entry another process is compiling right now (its
    lease live in the remote): it waits and loads what that process pushes, instead of failing."""
    import aotc
    from aotc.fleet.sync import push_entry
    from aotc.lookup.resolve import base_factors
    from aotc.lookup.toolchain import machine_factors
    from aotc.manifest import load_manifest
    from aotc.records.key import compute_key

    monkeypatch.setenv("AOTC_ALLOW_UNSIGNED", "1")
    _tmp, store, results = compiled
    manifest, key = results[2][0], results[2][1].key
    remote = S3Remote(f"s3://{s3()}/inflight", s3.endpoint)
    m = load_manifest(manifest)
    probe = compute_key(base_factors(m, machine_factors(m.device, store.base / "toolchain")))
    holder = LeaseInfo("builder:7:beef", time.time(), time.time() + 60, m.name)
    remote.put(f"leases/{probe}.json", holder.to_bytes())

    def finish_compile() -> None:  # the holder pushes, then releases
        time.sleep(2.0)
        push_entry(store, remote, key)
        remote.delete(f"leases/{probe}.json")

    threading.Thread(target=finish_compile).start()
    t = time.monotonic()
    runner = aotc.load(manifest, store=tmp_path / "replica", remote=remote.url)
    assert runner.key == key and time.monotonic() - t >= 1.5
    assert Store(tmp_path / "replica").keys() == [key]
