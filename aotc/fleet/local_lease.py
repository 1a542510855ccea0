"""One compile per node: the local build lease, in front of the remote's (:mod:`aotc.fleet.lease`).

Processes sharing one local store that miss the same entry at once would each compile it. The
one about to build takes an exclusive ``flock`` on ``<root>/store-v1/locks/build-<lease id>``
(:mod:`aotc.cache.locks`) without waiting; holding it, it looks in the local store again
(another process may have stored the entry between its miss and its lock), else builds — the
remote's pull and lease included, so only one process per node even asks the remote — and lets
go once the build has stored its entry. Every other process finds the lock held, says so in one
progress line, waits on it (at most ``max_wait``: ``AOTC_LEASE_WAIT``, the remote lease's bound)
and looks again: the entry the holder stored, or — the holder failed, or was killed (the kernel
releases its lock with its descriptors: nothing to expire) — the lock, now its own, under which
it builds itself. A build that fails in the caller's own way (the backend's remembered failures,
:mod:`aotc.backend.given_up`) fails the same way for a waiter that then builds: ``build`` is the
caller's whole path, so a recorded failure is read there, never retried in a loop. A waiter past
its bound looks once more and then builds without the lease (one warning), as a remote waiter
does. A read-only store has no lease (no lock file can be created): ``build`` runs as before
(a lock file that cannot be made otherwise: one warning, the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from aotc.cache import Store
from aotc.cache.locks import FileLock, lock_path
from aotc.log import logger

__all__ = ["node_single_flight"]

T = TypeVar("T")
_LOG = logger("lease")


def node_single_flight(store: Store, lease_id: str, what: str, look: Callable[[], T | None],
                       build: Callable[[], T], max_wait: float,
                       say: Callable[[str], None] | None = None) -> T:
    """``look()`` (what the local store holds now; None: nothing) else ``build()`` — under the
    local build lease ``lease_id`` of ``store`` so that one process of this node builds at a time
    (module doc). ``what`` names the work in messages; ``say`` gets the waiting line (default:
    the ``aotc.lease`` logger at info)."""
    if store.read_only:
        return build()
    lock = FileLock(lock_path(store.base, "build", lease_id))
    try:
        free = lock.acquire(timeout=0)
    except OSError as e:  # the lock file cannot be made (a store writable only in part): no lease
        _LOG.warning("aotc: no build lease for %s (%s: %s); compiling here", what, lock.path, e)
        return build()
    try:
        if not free:
            (say or _LOG.info)(f"aotc: waiting for another process on this node compiling {what} "
                               f"(lock {lock.path})")
            if not lock.acquire(timeout=max(0.0, max_wait)):
                got = look()
                if got is not None:
                    return got
                _LOG.warning("aotc: waited %.0fs for another process on this node to compile %s "
                             "(lock %s); compiling here", max_wait, what, lock.path)
                return build()
        got = look()  # stored between our miss and our lock, or by the holder we waited for
        return got if got is not None else build()
    finally:
        lock.release()
