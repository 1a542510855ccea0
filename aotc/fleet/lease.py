"""Single flight across a fleet: N processes that miss the same entry at once compile it once.

A process that finds the entry neither locally nor in the remote takes the compile **lease**
for it in the remote — ``leases/<id>.json``, created with a conditional write (S3
``If-None-Match: *``), holding its owner, when it was taken and its expiry — compiles, pushes,
and releases it. A heartbeat thread renews the expiry while the holder works. Every other
process sees the lease, waits (one progress line now and then: who holds it, since when), and
pulls the entry when it appears. A lease whose holder died stops being renewed, expires, and the
next waiter takes it over. A waiter never waits past its bound (``AOTC_LEASE_WAIT``): then it
compiles itself.

**One holder at a time** (compare-and-swap on the lease's ETag, where the remote has it): a
lease is read with its ETag; an expired one is taken over by *replacing* it with ``If-Match:
<that ETag>`` — of several waiters that saw it expire, exactly one write succeeds, the others
get 412 and wait on the new holder; the heartbeat renews with ``If-Match`` on the ETag of the
lease this process wrote last, so a refused renewal means the lease was taken over: the
heartbeat stops (said once) and never writes over the new holder's lease; release is a delete
with ``If-Match`` (it never removes a lease another took over). What the remote honours is
probed once per URL (:func:`conditional_writes`, :func:`compare_and_swap`):

- S3 with ``If-None-Match`` and ``If-Match`` on PUT and DELETE (AWS S3 since November 2024,
  MinIO; tested against moto 5.2.5's server, boto3/botocore 1.44.8): as above.
- An S3-compatible server with conditional creates but no ``If-Match``: said in one line, and
  the lease works as before — take-over by read-compare-delete then a conditional create,
  heartbeat by read-compare-put, release by read-compare-delete. A take-over racing another, or
  a heartbeat racing a take-over, can then leave two holders: two compiles of one key.
- A remote without conditional creates (an OCI registry: ``docker-registry`` 2.8.2 ignores
  ``If-Match`` / ``If-None-Match``, see :mod:`aotc.fleet.oci`): said in one line; no leases,
  every process compiles.

The lease is an optimisation, never a condition of correctness: two holders mean two compiles
of one key, which the store already makes safe (the same key, either build). Times in a lease
are the holder's wall clock; the TTL (``AOTC_LEASE_TTL``) should be well above the clock skew
between machines (a holder whose clock runs far behind can still see its lease expire early).
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
from typing import TypeVar

from aotc.errors import RemoteError
from aotc.fleet.remote_api import Remote, Unconditional
from aotc.log import logger

__all__ = ["LeaseInfo", "compare_and_swap", "conditional_writes", "single_flight", "wait_for_holder"]

T = TypeVar("T")
_LOG = logger("lease")
# remote URL -> (conditional creates honoured, If-Match honoured, until when that answer holds:
# a remote that could not be written is asked again after a while — a network blip must not
# turn leases off for good)
_SUPPORT: dict[str, tuple[bool, bool, float]] = {}
_RETRY_PROBE = 300.0
_NO_ETAG = '"00000000000000000000000000000000"'  # an ETag no object has: a swap must be refused


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


def conditional_writes(remote: Remote) -> bool:
    """Whether the remote honours conditional creates and deletes: leases at all (probed once
    per URL, with :func:`compare_and_swap`'s question: create an object twice with
    ``If-None-Match: *`` — the second must be refused —, replace it with ``If-Match``, delete it)."""
    known = _SUPPORT.get(remote.url)
    if known is None or time.monotonic() > known[2]:
        create, swap, why, until = False, False, "does not honour conditional writes", float("inf")
        try:
            create, swap = _probe(remote)
        except Unconditional:  # the server answered "not implemented": no leases there, for good
            create = swap = False
        except RemoteError as e:  # read-only (or no-delete) credentials: no leases, never a failed start
            why, until = f"cannot be written or deleted in ({e})", time.monotonic() + _RETRY_PROBE
            create = swap = False
        _SUPPORT[remote.url] = (create, swap, until)
        if not create:
            _LOG.warning("aotc: %s %s: no compile leases, each process that misses compiles "
                         "(as before)", remote.url, why)
        elif not swap:
            _LOG.warning("aotc: %s honours conditional creates but not If-Match: a compile lease is "
                         "taken over and renewed by read-compare-write there (a race can leave two "
                         "holders: two compiles of one key)", remote.url)
    return _SUPPORT[remote.url][0]


def compare_and_swap(remote: Remote) -> bool:
    """Whether the remote honours ``If-Match`` on PUT and DELETE too (module doc): a lease is
    then taken over, renewed and released only if it is still the version this process read."""
    return conditional_writes(remote) and _SUPPORT[remote.url][1]


def _probe(remote: Remote) -> tuple[bool, bool]:
    """(conditional creates honoured, If-Match honoured) — a probe object outside ``leases/``
    (never mistaken for one), removed after."""
    if not remote.conditional:
        return False, False
    probe = f"lease-probes/{uuid.uuid4().hex}"
    first = remote.put_tagged(probe, b"1", if_absent=True)
    if first is None:
        return False, False
    try:
        if remote.put_tagged(probe, b"2", if_absent=True) is not None:
            return False, False
        try:
            if remote.put_tagged(probe, b"3", if_match=_NO_ETAG) is not None:
                return True, False
            second = remote.put_tagged(probe, b"4", if_match=first)
            swap = (second is not None and remote.get_bytes(probe) == b"4"
                    and not remote.delete_if_match(probe, first)
                    and remote.delete_if_match(probe, second))
            return True, swap
        except Unconditional:
            return True, False
    finally:
        remote.delete(probe)  # gone already after a good swap probe; a denied delete: no leases


def _swap(remote: Remote, name: str, body: bytes, etag: str) -> str | None:
    """Replace ``name`` with ``body`` if it is still version ``etag``: the new version, or None
    when another wrote it first. A write that reached the remote but whose answer was lost (the
    client's retry is then refused) is recognised by its bytes, unique to this process."""
    new = remote.put_tagged(name, body, if_match=etag)
    if new is None:
        now = remote.get_tagged(name)
        if now is not None and now.data == body:
            return now.etag
    return new


class _Held:
    """A lease this process holds, renewed by a heartbeat thread until released. ``etag``: the
    version of the lease this process wrote last (None on a remote without If-Match: then the
    renewal and the release are read-compare-write)."""

    def __init__(self, remote: Remote, lease_id: str, info: LeaseInfo, ttl: float,
                 etag: str | None) -> None:
        self.remote, self.name, self.info, self.ttl, self.etag = remote, _name(lease_id), info, ttl, etag
        self.lost = False  # taken over by another: no more heartbeats, nothing to release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="aotc-lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                if not self._renew():
                    return
            except Exception as e:  # noqa: BLE001 - a lost heartbeat only risks a second compile
                _LOG.warning("aotc: lease heartbeat failed (%s); compiling on", e)

    def _renew(self) -> bool:
        """One heartbeat; False when the lease was taken over (said once) or released."""
        info = LeaseInfo(self.info.owner, self.info.since, time.time() + self.ttl, self.info.what)
        if self.etag is None:  # no If-Match: read, compare, put (a race can write over a take-over)
            now = LeaseInfo.parse(self.remote.get_bytes(self.name))
            if now is None or now.owner != self.info.owner:
                return self._taken_over(now)
            if self._stop.is_set():  # released meanwhile: never put a lease back
                return False
            self.remote.put(self.name, info.to_bytes())
            self.info = info
            return True
        if self._stop.is_set():
            return False
        new = _swap(self.remote, self.name, info.to_bytes(), self.etag)
        if new is None:  # another process replaced (took over) or removed our lease
            return self._taken_over(LeaseInfo.parse(self.remote.get_bytes(self.name)))
        self.etag, self.info = new, info
        return True

    def _taken_over(self, now: LeaseInfo | None) -> bool:
        self.lost = True
        _LOG.warning("aotc: the compile lease for %s was taken over (by %s); compiling on, without "
                     "renewing it", self.info.what, now.owner if now else "nobody")
        return False

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.lost:
            return
        try:
            if self.etag is not None:
                self.remote.delete_if_match(self.name, self.etag)  # False: not ours any more
            else:
                now = LeaseInfo.parse(self.remote.get_bytes(self.name))
                if now is not None and now.owner == self.info.owner:
                    self.remote.delete(self.name)
        except Exception as e:  # noqa: BLE001 - it expires on its own
            _LOG.warning("aotc: could not release the compile lease for %s (%s); it expires in %.0fs",
                         self.info.what, e, self.ttl)


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _new_lease(what: str, ttl: float) -> LeaseInfo:
    now = time.time()
    return LeaseInfo(_owner(), now, now + ttl, what)


def _try_take(remote: Remote, lease_id: str, what: str,
              ttl: float) -> tuple[_Held | None, LeaseInfo | None, str | None]:
    """(the lease, created with a conditional write; None when another holds it, or nobody by
    now), (who holds it then) and (the ETag of that lease). A create that reached the remote but
    whose answer was lost (the client's retry then sees its own object and is refused) is
    recognised by its owner: never wait on one's own lease."""
    info, swap = _new_lease(what, ttl), compare_and_swap(remote)
    if swap:
        etag = remote.put_tagged(_name(lease_id), info.to_bytes(), if_absent=True)
        if etag is not None:
            return _Held(remote, lease_id, info, ttl, etag), None, None
    elif remote.put(_name(lease_id), info.to_bytes(), if_absent=True):
        return _Held(remote, lease_id, info, ttl, None), None, None
    there = remote.get_tagged(_name(lease_id))
    holder = LeaseInfo.parse(there.data if there is not None else None)
    if there is not None and holder is not None and holder.owner == info.owner:
        return _Held(remote, lease_id, info, ttl, there.etag if swap else None), None, None
    return None, holder, there.etag if there is not None else None


def single_flight(remote: Remote, lease_id: str, what: str, fetch: Callable[[], T | None],
                  build: Callable[[], T], ttl: float, max_wait: float, poll: float = 1.0,
                  say: Callable[[str], None] | None = None) -> T:
    """``fetch()`` (the entry from the remote, pulled; None when it has none) else ``build()``
    (compile and push) — under the remote's compile lease ``lease_id`` so that only one process
    builds at a time (module doc). ``what`` names the work in messages; ``say`` gets the waiting
    lines (default: the ``aotc.lease`` logger at info)."""
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
            held, holder, etag = _try_take(remote, lease_id, what, ttl)
            if holder is not None and etag is not None and holder.expires < time.time():
                held = _take_over(remote, lease_id, holder, etag, ttl)
                if held is None:
                    continue  # another waiter took it over first (or, without If-Match: removed)
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


def wait_for_holder(remote: Remote, lease_id: str, what: str, fetch: Callable[[], T | None],
                    max_wait: float, poll: float = 1.0,
                    say: Callable[[str], None] | None = None) -> T | None:
    """For a process that only loads (``aotc.load`` with pull-through): while another process
    holds a live compile lease ``lease_id``, wait (bounded by ``max_wait``) and ``fetch()`` the
    entry as soon as it is there. None when nobody holds the lease, it expired or was released
    without the entry, or the bound passed."""
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


def _take_over(remote: Remote, lease_id: str, expired: LeaseInfo, etag: str,
               ttl: float) -> _Held | None:
    """Take over an expired lease read as version ``etag``: replace it with ours if it is still
    that version (``If-Match``; of several waiters exactly one succeeds) — our lease, or None when
    another took it over first. Without If-Match: remove it only if it still reads the same (a
    race can remove another's fresh lease) and None: the caller's next round creates its own."""
    name = _name(lease_id)
    if compare_and_swap(remote):
        info = _new_lease(expired.what, ttl)
        new = _swap(remote, name, info.to_bytes(), etag)
        if new is None:
            return None
        _LOG.warning("aotc: the compile lease of %s on %s expired (its holder stopped); taking it "
                     "over (done: this process holds it now)", expired.owner, expired.what)
        return _Held(remote, lease_id, info, ttl, new)
    again = LeaseInfo.parse(remote.get_bytes(name))
    if again == expired:
        _LOG.warning("aotc: the compile lease of %s on %s expired (its holder stopped); taking it over",
                     expired.owner, expired.what)
        remote.delete(name)
    return None


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
