"""The store as the loader and the backend see it: the local store with an optional remote tier
(ccache's secondary storage, Bazel's remote cache). Asked for an entry the local store lacks, it
pulls it through from the remote — every blob verified, the trust policy enforced before any blob
is read — into the local store, and answers from there. Callers never walk runtime → sync →
records themselves: they ask :meth:`TieredStore.get` (by key) or :meth:`TieredStore.find`
(what a manifest compiles to on this machine).

The remote's client (boto3) is imported only when the remote tier is actually asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aotc.cache import CacheMiss, Entry, Store, StoreReadOnlyError
from aotc.lookup.resolve import Resolution, resolve
from aotc.progress import Progress

__all__ = ["TieredStore", "open_tiered"]


@dataclass
class TieredStore:
    """``local`` in front of ``remote`` (None: no remote tier), under the ``trusted`` keys."""

    local: Store
    remote: Any = None  # an aotc.fleet.remote.S3Remote
    trusted: frozenset[str] = frozenset()
    pulled_bytes: int = 0  # bytes the remote tier moved for this object's pulls
    pull_seconds: float = 0.0
    progress: Progress = field(default_factory=Progress)
    lease_wait: float = 0.0  # a miss being compiled elsewhere (a live lease): wait that long for it

    def has(self, key: str) -> bool:
        """Whether the local tier holds ``key`` (the remote is not asked)."""
        return self.local.has(key)

    def get(self, key: str, miss_hint: str = "") -> Entry:
        """The entry ``key``: local, else pulled through from the remote (module doc). Raises
        ``CacheMiss`` (with ``miss_hint`` when no tier has it), ``RemoteError`` for damaged or
        unreachable remote bytes, ``TrustError`` for an entry the policy refuses."""
        if not self.local.has(key):
            if self.remote is None:
                raise CacheMiss(key, hint=miss_hint or f"the store {self.local.root} has no entry "
                                                       f"{key[:16]}… (set AOTC_REMOTE to pull it)")
            self._writable(f"pull {key[:16]}… into it from {self.remote.url}")
            from aotc.fleet.sync import pull_entry

            t = time.perf_counter()
            misses: list[CacheMiss] = []

            def pull() -> Any:
                try:
                    return pull_entry(self.remote, self.local, key, self.trusted, self.progress)
                except CacheMiss as e:
                    misses.append(e)
                    return None

            pulled = pull()
            if pulled is None and self.lease_wait > 0:  # being compiled elsewhere? wait for it
                from aotc.fleet.lease import wait_for_holder

                pulled = wait_for_holder(self.remote, key, f"{key[:16]}…", pull, self.lease_wait)
            if pulled is None:
                raise misses[0]
            self._pulled(pulled.bytes_moved, time.perf_counter() - t)
        return self.local.get(key)

    def find(self, manifest: Any, machine: dict[str, Any]) -> Resolution:
        """What ``manifest`` compiles to on this ``machine``: resolved in the local tier, else
        pulled through from the remote and resolved again. A local entry that exists but is
        damaged is reported (``Resolution.corrupt``), not replaced from the remote."""
        found = resolve(manifest, self.local, machine, record=True)
        if found.entry is not None or found.corrupt is not None or self.remote is None:
            return found
        self._writable(f"pull {manifest.name} into it from {self.remote.url}")
        from aotc.fleet.sync import pull_for_manifest

        t = time.perf_counter()

        def pull() -> Any:
            return pull_for_manifest(manifest, self.remote, self.local, machine, self.trusted,
                                     self.progress)

        pulled = pull()
        if pulled is None and self.lease_wait > 0:  # being compiled elsewhere right now? wait for it
            from aotc.fleet.lease import wait_for_holder

            pulled = wait_for_holder(self.remote, found.probe, manifest.name, pull, self.lease_wait)
        if pulled is None:
            return found
        self._pulled(pulled.bytes_moved, time.perf_counter() - t)
        return resolve(manifest, self.local, machine, record=True)

    def _writable(self, what: str) -> None:
        if self.local.read_only:
            raise StoreReadOnlyError(str(self.local.root), what)

    def _pulled(self, moved: int, seconds: float) -> None:
        self.pulled_bytes += moved
        self.pull_seconds += seconds


def open_tiered(store: Any = None, remote: Any = None, trusted: frozenset[str] = frozenset(),
                settings: Any = None, manifest: Any = None, create: bool = False) -> TieredStore:
    """The tiered store a caller means: ``store`` (a ``Store``, a directory, an ``s3://`` URL
    that then is the remote in front of the default local store; default ``AOTC_STORE``, else the
    manifest's ``store`` field) and ``remote`` (a URL or a remote; default ``AOTC_REMOTE``).
    The local store is created when missing if ``create`` or a remote tier is set."""
    from aotc.lookup.stores import open_store, split_store
    from aotc.settings import current

    local, rem = split_store(store, remote, settings)
    return TieredStore(open_store(local, manifest, create=create or rem is not None, settings=settings),
                       rem, trusted, lease_wait=(settings or current()).lease_wait)
