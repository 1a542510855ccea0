"""Hole 8: never two holders of one compile lease (:mod:`aotc.fleet.lease`), against the real S3
test server (moto's, on loopback; ``If-Match`` on PUT and DELETE as AWS S3 has had since
November 2024).

The races are made certain, not hoped for: the remote is the real one, and only the *timing* of
this process's own lease writes is changed — a write that goes out late (a slow network, a GC
pause, a stopped VM), after another process has already acted. Every request still reaches the
server and gets the server's answer; nothing is mocked."""

from __future__ import annotations

import threading
import time

from aotc.fleet.lease import LeaseInfo, compare_and_swap, conditional_writes, single_flight
from aotc.fleet.remote import S3Remote


class _LateWrites(S3Remote):
    """The real S3 remote, whose first write to a lease after the initial create attempt (a
    take-over, a heartbeat, a release) goes out late for the threads named in ``delays`` (thread
    name -> seconds). With ``barrier``, each such thread first waits there: every racer has read
    the lease before any of them writes it."""

    def __init__(self, s3, url: str, delays: dict[str, float],  # type: ignore[no-untyped-def]
                 barrier: threading.Barrier | None = None) -> None:
        super().__init__(url, s3.endpoint)
        self.delays, self.barrier = delays, barrier
        self.delayed: list[str] = []  # the threads whose write was held back

    def _late(self, name: str) -> None:
        who = threading.current_thread().name
        if not name.startswith("leases/") or who not in self.delays or who in self.delayed:
            return
        self.delayed.append(who)
        if self.barrier is not None:
            try:
                self.barrier.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass
        time.sleep(self.delays[who])

    def put(self, name: str, body, if_absent: bool = False, strict: bool = False):  # type: ignore[no-untyped-def, override]
        if not if_absent:
            self._late(name)
        return super().put(name, body, if_absent=if_absent, strict=strict)

    def put_tagged(self, name: str, body: bytes, if_match=None, if_absent: bool = False):  # type: ignore[no-untyped-def, override]
        if not if_absent:
            self._late(name)
        return super().put_tagged(name, body, if_match=if_match, if_absent=if_absent)

    def delete(self, name: str) -> None:
        self._late(name)
        super().delete(name)

    def delete_if_match(self, name: str, etag: str) -> bool:
        self._late(name)
        return super().delete_if_match(name, etag)


def test_the_test_server_honours_compare_and_swap(s3) -> None:
    remote = S3Remote(f"s3://{s3()}/fleet", s3.endpoint)
    assert conditional_writes(remote) and compare_and_swap(remote)
    first = remote.put_tagged("o", b"1", if_absent=True)
    assert first is not None and remote.put_tagged("o", b"2", if_absent=True) is None
    got = remote.get_tagged("o")
    assert got is not None and (got.data, got.etag) == (b"1", first)
    assert remote.put_tagged("o", b"3", if_match='"' + "0" * 32 + '"') is None  # another version
    second = remote.put_tagged("o", b"4", if_match=first)
    assert second is not None and second != first and remote.get_bytes("o") == b"4"
    assert remote.put_tagged("o", b"5", if_match=first) is None  # stale: refused
    assert not remote.delete_if_match("o", first) and remote.get_bytes("o") == b"4"
    assert remote.delete_if_match("o", second) and remote.get_bytes("o") is None
    assert remote.put_tagged("o", b"6", if_match=second) is None  # gone: refused, not created
    assert not remote.delete_if_match("o", second) and remote.get_bytes("o") is None


def test_two_waiters_taking_over_one_expired_lease_make_one_holder(s3, caplog) -> None:
    """Both waiters read the dead holder's expired lease; the take-over write of one goes out
    a second late. With read-compare-delete (before): the late one deletes the lease the
    other has just taken, creates its own, and both compile. With ``If-Match`` on the ETag read:
    the late write is refused, and the late waiter waits for the new holder instead."""
    url = f"s3://{s3()}/fleet"
    remote = _LateWrites(s3, url, {"waiter-a": 0.0, "waiter-b": 1.0}, threading.Barrier(2))
    dead = LeaseInfo("gone:1:dead", time.time() - 100, time.time() - 1, "toy")
    remote.put("leases/k8.json", dead.to_bytes(), if_absent=True)
    stored: list[str] = []
    builds: list[str] = []
    results: list[str] = []

    def build() -> str:
        builds.append(threading.current_thread().name)
        time.sleep(3.0)  # a compile, long past the late write
        stored.append("entry")
        return "built"

    def waiter() -> None:
        results.append(single_flight(remote, "k8", "toy", lambda: stored[0] if stored else None,
                                     build, ttl=30, max_wait=60, poll=0.1))

    threads = [threading.Thread(target=waiter, name=n) for n in ("waiter-a", "waiter-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(remote.delayed) == ["waiter-a", "waiter-b"]  # both reached the take-over write
    assert builds == ["waiter-a"], f"two holders of one lease: {builds} compiled"
    assert sorted(results) == ["built", "entry"]
    took = [r.getMessage() for r in caplog.records if "taking it over" in r.getMessage()]
    assert len(took) == 1 and "gone:1:dead" in took[0]
    assert list(remote.list("leases/")) == []  # released


def test_a_heartbeat_after_a_take_over_never_overwrites_the_new_holder(s3, caplog) -> None:
    """Holder A's heartbeat stalls (its renewal goes out 3 s late, past A's 1 s TTL): B takes the
    expired lease over and compiles. A's late renewal must not write A's lease back over B's
    (before: an unconditional PUT did, and B then believed itself taken over): it is refused,
    A stops renewing and says so once, and B's lease stands the whole time it compiles."""
    url = f"s3://{s3()}/fleet"
    a_remote = _LateWrites(s3, url, {"aotc-lease-heartbeat": 3.0})
    b_remote = S3Remote(url, s3.endpoint)
    watch = S3Remote(url, s3.endpoint)
    seen_by_b: list[str] = []
    stored: list[str] = []
    a_holds = threading.Event()

    def build_a() -> str:
        a_holds.set()
        time.sleep(6.0)  # still compiling when B has taken over and A's renewal lands
        return "built by a"

    def build_b() -> str:
        for _ in range(45):  # 4.5 s from B's take-over (~1.1 s after A took the lease); A's
            # late renewal lands at ~3.25 s
            info = LeaseInfo.parse(watch.get_bytes("leases/k9.json"))
            seen_by_b.append(info.owner if info else "nobody")
            time.sleep(0.1)
        stored.append("entry")
        return "built by b"

    results: dict[str, str] = {}
    a = threading.Thread(target=lambda: results.update(a=single_flight(
        a_remote, "k9", "toy", lambda: None, build_a, ttl=1.0, max_wait=60, poll=0.1)))
    a.start()
    assert a_holds.wait(30)
    b = threading.Thread(target=lambda: results.update(b=single_flight(
        b_remote, "k9", "toy", lambda: stored[0] if stored else None, build_b, ttl=1.0,
        max_wait=60, poll=0.1)))
    b.start()
    for t in (a, b):
        t.join()
    assert results == {"a": "built by a", "b": "built by b"}
    assert a_remote.delayed == ["aotc-lease-heartbeat"]  # A's renewal did go out late
    assert len(set(seen_by_b)) == 1 and seen_by_b[0] != "nobody", (
        f"B's lease was overwritten while B compiled: owners seen {sorted(set(seen_by_b))}")
    lost = [r.getMessage() for r in caplog.records if "was taken over" in r.getMessage()]
    assert len(lost) == 1 and seen_by_b[0] in lost[0]  # A, once, naming B
    assert list(b_remote.list("leases/")) == []  # B released its own; A removed nothing


class _IgnoresIfMatch(S3Remote):
    """The real S3 remote as an S3-compatible server without ``If-Match`` treats it (conditional
    creates only, as AWS S3 between August and November 2024): the header is not sent."""

    def put_tagged(self, name: str, body: bytes, if_match=None, if_absent: bool = False):  # type: ignore[no-untyped-def, override]
        return super().put_tagged(name, body, if_absent=if_absent)

    def delete_if_match(self, name: str, etag: str) -> bool:
        self.delete(name)
        return True


def test_without_if_match_leases_work_as_before_and_say_so(s3, caplog) -> None:
    remote = _IgnoresIfMatch(f"s3://{s3()}/fleet", s3.endpoint)
    assert conditional_writes(remote) and not compare_and_swap(remote)
    said = [r.getMessage() for r in caplog.records if "not If-Match" in r.getMessage()]
    assert len(said) == 1 and remote.url in said[0]
    dead = LeaseInfo("gone:1:dead", time.time() - 100, time.time() - 1, "toy")
    remote.put("leases/k10.json", dead.to_bytes())
    seen: list[LeaseInfo | None] = []

    def build() -> str:
        time.sleep(0.6)  # past a few heartbeats (read-compare-put here)
        seen.append(LeaseInfo.parse(remote.get_bytes("leases/k10.json")))
        return "mine"

    assert single_flight(remote, "k10", "toy", lambda: None, build, ttl=1.0, max_wait=60, poll=0.1) == "mine"
    assert seen[0] is not None and seen[0].owner != dead.owner and seen[0].expires > time.time() - 1
    assert any("taking it over" in r.getMessage() for r in caplog.records)
    assert list(remote.list("leases/")) == []
