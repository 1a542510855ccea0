"""Single flight across a fleet: N processes that miss the same entry at once compile it once.

A process that finds the entry neither locally nor in the remote takes the compile **lease**
for it in the remote — ``leases/<id>.json``, created with a conditional write (S3
``If-None-Match: *``), holding its owner, when it was taken and its expiry — compiles, pushes,
and releases it. A heartbeat thread renews the expiry while the holder works. Every other
process sees the lease, waits (one progress line now and then: who holds it, since when), and
pulls the entry when it appears. A lease whose holder died stops being renewed, expires, and the
next waiter takes it over. A waiter never waits past its bound (``AOTC_LEASE_WAIT``): then it
compiles itself. A remote that does not honour conditional writes is detected once and said in
one line; then every process compiles, as without leases.

The lease is an optimisation, never a condition of correctness: two holders (clocks far apart,
a take-over racing a slow heartbeat) mean two compiles of one key, which the store already
makes safe (the same key, either build). Times in a lease are the holder's wall clock; the TTL
(``AOTC_LEASE_TTL``) should be well above the clock skew between machines.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aotc.log import logger

__all__ = ["LeaseInfo", "conditional_writes", "single_flight", "wait_for_holder"]

T = TypeVar("T")
_LOG = logger("lease")
# remote URL -> (conditional writes honoured, until when that answer holds: a remote that could
# not be written is asked again after a while — a network blip must not turn leases off for good)
_SUPPORT: dict[str, tuple[bool, float]] = {}
_RETRY_PROBE = 300.0


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as read from the remote."""

    owner: str
    since: float
    expires: float
    what: str

    def to_bytes(self) -> bytes:
        return json.dumps({"owner": self.owner, "since": self.since, "expires": self.expires,
                           "what": self.what}, sort_keys=True).encode()

    @staticmethod
    def parse(raw: bytes | None) -> LeaseInfo | None:
        """The lease in ``raw``; a damaged one reads as expired long ago (it can be taken over)."""
        if raw is None:
            return None
        try:
            d = json.loads(raw)
            return LeaseInfo(str(d["owner"]), float(d["since"]), float(d["expires"]), str(d.get("what", "")))
        except (ValueError, KeyError, TypeError):
            return LeaseInfo("?", 0.0, 0.0, "a damaged lease")


def _name(lease_id: str) -> str:
    return f"leases/{lease_id}.json"


def conditional_writes(remote: Any) -> bool:
    """Whether the remote honours conditional creates and deletes (probed once per URL: create
    an object twice with ``If-None-Match: *`` — the second must be refused — then delete it: a
    dead holder's lease is taken over by deleting it)."""
    known = _SUPPORT.get(remote.url)
    if known is None or time.monotonic() > known[1]:
        from aotc.errors import RemoteError

        probe = f"lease-probes/{uuid.uuid4().hex}"  # outside leases/: never mistaken for one
        ok, why, until = False, "does not honour conditional writes", float("inf")
        try:
            first = remote.put(probe, b"", if_absent=True, strict=True)
            second = remote.put(probe, b"", if_absent=True, strict=True)
            ok = first is True and second is False
            if first is True:
                remote.delete(probe)
        except RemoteError as e:  # read-only (or no-delete) credentials: no leases, never a failed start
            ok, why, until = False, f"cannot be written or deleted in ({e})", time.monotonic() + _RETRY_PROBE
        _SUPPORT[remote.url] = (ok, until)
        if not ok:
            _LOG.warning("aotc: %s %s: no compile leases, each process that misses compiles "
                         "(as before)", remote.url, why)
    return _SUPPORT[remote.url][0]


class _Held:
    """A lease this process holds, renewed by a heartbeat thread until released."""

    def __init__(self, remote: Any, lease_id: str, info: LeaseInfo, ttl: float) -> None:
        self.remote, self.name, self.info, self.ttl = remote, _name(lease_id), info, ttl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="aotc-lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                now = LeaseInfo.parse(self.remote.get_bytes(self.name))
                if now is None or now.owner != self.info.owner:
                    _LOG.warning("aotc: the compile lease for %s was taken over (by %s); compiling on",
                                 self.info.what, now.owner if now else "nobody")
                    return
                if self._stop.is_set():  # released meanwhile: never put a lease back
                    return
                self.info = LeaseInfo(self.info.owner, self.info.since, time.time() + self.ttl, self.info.what)
                self.remote.put(self.name, self.info.to_bytes())
            except Exception as e:  # noqa: BLE001 - a lost heartbeat only risks a second compile
                _LOG.warning("aotc: lease heartbeat failed (%s); compiling on", e)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            now = LeaseInfo.parse(self.remote.get_bytes(self.name))
            if now is not None and now.owner == self.info.owner:
                self.remote.delete(self.name)
        except Exception as e:  # noqa: BLE001 - it expires on its own
            _LOG.warning("aotc: could not release the compile lease for %s (%s); it expires in %.0fs",
                         self.info.what, e, self.ttl)


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _try_take(remote: Any, lease_id: str, what: str,
              ttl: float) -> tuple[_Held | None, LeaseInfo | None]:
    """(the lease, created with a conditional write; None when another holds it, or nobody by
    now) and (who holds it then). A create that reached the remote but whose answer was lost
    (the client's retry then sees its own object and is refused) is recognised by its owner:
    never wait on one's own lease."""
    now = time.time()
    info = LeaseInfo(_owner(), now, now + ttl, what)
    if remote.put(_name(lease_id), info.to_bytes(), if_absent=True):
        return _Held(remote, lease_id, info, ttl), None
    there = LeaseInfo.parse(remote.get_bytes(_name(lease_id)))
    if there is not None and there.owner == info.owner:
        return _Held(remote, lease_id, info, ttl), None
    return None, there


def single_flight(remote: Any, lease_id: str, what: str, fetch: Callable[[], T | None],
                  build: Callable[[], T], ttl: float, max_wait: float, poll: float = 1.0,
                  say: Callable[[str], None] | None = None) -> T:
    """``fetch()`` (the entry from the remote, pulled; None when it has none) else ``build()``
    (compile and push) — under the remote's compile lease ``lease_id`` so that only one process
    builds at a time (module doc). ``what`` names the work in messages; ``say`` gets the waiting
    lines (default: the ``aotc.lease`` logger at info)."""
    from aotc.errors import RemoteError

    now_and_then = _NowAndThen(say or _LOG.info)
    if not conditional_writes(remote):
        got = fetch()
        return got if got is not None else build()
    start = time.monotonic()
    holder: LeaseInfo | None = None
    while True:
        if time.monotonic() - start > max_wait:  # checked on every round, whatever it met
            _LOG.warning("aotc: waited %.0fs for %s to compile %s; compiling here",
                         time.monotonic() - start, holder.owner if holder else "another process", what)
            return build()
        got = fetch()
        if got is not None:
            return got
        try:  # the lease's own calls: a remote failing them means no lease, never a failed call
            held, holder = _try_take(remote, lease_id, what, ttl)
            if holder is not None and holder.expires < time.time():
                _take_over(remote, lease_id, holder)
                continue
        except RemoteError as e:
            _LOG.warning("aotc: the compile lease for %s in %s failed (%s); compiling here", what,
                         remote.url, e)
            return build()
        if held is not None:
            try:
                got = fetch()  # stored between our look and our lease: nothing to build
                return got if got is not None else build()
            finally:
                held.release()
        if holder is None:
            continue  # released just now: look again, then take it
        now_and_then(f"aotc: {holder.owner} is compiling {what} since {_clock(holder.since)} (its "
                     f"lease expires in {holder.expires - time.time():.0f}s unless renewed); waiting for it")
        time.sleep(poll)


def wait_for_holder(remote: Any, lease_id: str, what: str, fetch: Callable[[], T | None],
                    max_wait: float, poll: float = 1.0,
                    say: Callable[[str], None] | None = None) -> T | None:
    """For a process that only loads (``aotc.load`` with pull-through): while another process
    holds a live compile lease ``lease_id``, wait (bounded by ``max_wait``) and ``fetch()`` the
    entry as soon as it is there. None when nobody holds the lease, it expired or was released
    without the entry, or the bound passed."""
    from aotc.errors import RemoteError

    now_and_then = _NowAndThen(say or _LOG.info)
    deadline = time.monotonic() + max_wait
    while True:
        try:
            holder = LeaseInfo.parse(remote.get_bytes(_name(lease_id)))
        except RemoteError as e:  # the lease cannot be read: no wait, the caller's miss stands
            _LOG.warning("aotc: the compile lease for %s in %s cannot be read (%s)", what, remote.url, e)
            return None
        if holder is None or holder.expires < time.time():
            return fetch()  # one last look: it may have been pushed just before the release
        got = fetch()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            _LOG.warning("aotc: waited %.0fs for %s to compile %s; not there yet",
                         max_wait + time.monotonic() - deadline, holder.owner, what)
            return None
        now_and_then(f"aotc: {holder.owner} is compiling {what} since {_clock(holder.since)}; "
                     "waiting to pull it")
        time.sleep(poll)


class _NowAndThen:
    """Passes a waiting line on at once, then at most every ``seconds``."""

    def __init__(self, say: Callable[[str], None], seconds: float = 10.0) -> None:
        self.say, self.seconds = say, seconds
        self.last: float | None = None

    def __call__(self, text: str) -> None:
        if self.last is None or time.monotonic() - self.last > self.seconds:
            self.last = time.monotonic()
            self.say(text)


def _take_over(remote: Any, lease_id: str, expired: LeaseInfo) -> None:
    """Remove an expired lease — only if it is still that same one (another waiter may have
    taken it over already)."""
    again = LeaseInfo.parse(remote.get_bytes(_name(lease_id)))
    if again == expired:
        _LOG.warning("aotc: the compile lease of %s on %s expired (its holder stopped); taking it over",
                     expired.owner, expired.what)
        remote.delete(_name(lease_id))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
