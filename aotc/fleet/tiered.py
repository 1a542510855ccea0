"""The store as every front door sees it: the local store with an optional remote tier (ccache's
secondary storage, Bazel's remote cache), and the one fleet journey.

:meth:`TieredStore.get_or_build` owns it: local → the node's build lease (a lock file in the
local store, :mod:`aotc.fleet.local_lease`: one process per node goes on, the others wait and
find its entry) → remote (pulled through, every blob verified,
the trust policy enforced before any blob is read) → the remote's compile lease (one process of a
fleet builds, the others wait and pull) → build (the caller's function, which stores with
:meth:`TieredStore.put`: signed in the same transaction when a signing key is set) → push. One
error policy: a remote entry that is unreachable, damaged or refused is one warning and a build
here; a failed push is one warning (the entry stands here; ``aotc push`` feeds the fleet later).
:meth:`TieredStore.get` / :meth:`TieredStore.find` are the loader's half (no build).

Which door takes which part: the manifest pipeline (by its probe), the backend (by the graph's
key) and ``aotc.precompile`` (its Dynamo artifact, by the key its trace computes) call
:meth:`~TieredStore.get_or_build` with only how to build. vLLM's AOT records (and their model
info) are files vLLM already wrote — nothing for aotc to build under a lease — so the plugin and
``aotc compile`` of a vLLM manifest call :meth:`~TieredStore.publish`, the journey's second half
alone (put, signed in its transaction → push). Whether what this process stores passes its trust
policy is one answer, :attr:`TieredStore.can_sign`: the backend, ``aotc.precompile`` and
``aotc.precompiled``'s first-call build ask it before any work.

Every one of them first checks that the local store is safe to load code from
(:func:`aotc.fleet.trust.enforce_store`: nobody but this user or root can write it, unless the
policy requires signatures): a store others could write raises ``UnsafeStoreError`` before
anything is looked up, pulled or built — no fallback to building into it either.

The remote's client (boto3, oras) is imported only when the remote tier is actually asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from aotc.cache import CacheMiss, Entry, Store, StoreReadOnlyError
from aotc.errors import RemoteError, TrustError
from aotc.fleet.remote_api import Remote
from aotc.fleet.trust import Signer, TrustPolicy, enforce, enforce_store, sign_with
from aotc.log import logger
from aotc.lookup.resolve import Probe, Resolution, manifest_probe, resolve_probe
from aotc.progress import Progress

if TYPE_CHECKING:
    from aotc.fleet.sync import Transfer

__all__ = ["Served", "TieredStore", "Wanted", "open_tiered", "pull_manifest"]

_LOG = logger("fleet")


class _Keyed(Protocol):
    @property
    def key(self) -> str: ...


T = TypeVar("T", bound=_Keyed)


@dataclass(frozen=True)
class Wanted:
    """What a front door asks for: an entry by ``key`` (the backend, a saved record), or the
    current entry behind a ``probe`` (:class:`aotc.lookup.resolve.Probe`: what a manifest
    compiles to on a machine, or a precompiled function — the key is known only after tracing;
    the lease is the probe's key). ``what`` names it in messages."""

    what: str
    key: str | None = None
    probe: Probe | None = None

    @classmethod
    def by_key(cls, key: str, what: str = "") -> Wanted:
        return cls(what or f"graph {key[:16]}…", key=key)

    @classmethod
    def by_manifest(cls, manifest: Any, machine: dict[str, Any]) -> Wanted:
        return cls.by_probe(manifest_probe(manifest, machine))

    @classmethod
    def by_probe(cls, probe: Probe, what: str = "") -> Wanted:
        return cls(what or probe.name, probe=probe)


@dataclass(frozen=True)
class Served(Generic[T]):
    """How :meth:`TieredStore.get_or_build` served: the ``entry`` found (local, or ``pulled``),
    or what ``build`` returned (``built``; ``pushed``: whether the push went, None: no remote)."""

    entry: Entry | None = None
    built: T | None = None
    pulled: bool = False
    pushed: bool | None = None


class _Refused(Exception):
    """The remote has the entry but it could not be pulled (the cause is ``args[0]``)."""


@dataclass
class TieredStore:
    """``local`` in front of ``remote`` (None: no remote tier), under the ``policy``; ``signer``
    signs what :meth:`put` stores; ``lease_ttl``/``lease_wait``: :mod:`aotc.fleet.lease`."""

    local: Store
    remote: Remote | None = None
    policy: TrustPolicy = field(default_factory=TrustPolicy)
    signer: Signer | None = None
    lease_ttl: float = 60.0
    lease_wait: float = 1800.0
    progress: Progress = field(default_factory=Progress)
    pulled_bytes: int = 0  # bytes the remote tier moved for this object's pulls
    pull_seconds: float = 0.0

    def has(self, key: str) -> bool:
        """Whether the local tier holds ``key`` (the remote is not asked)."""
        return self.local.has(key)

    @property
    def can_sign(self) -> bool:
        """Whether what this process stores here would pass its own trust policy: no trusted
        keys are required, or its signing key (``signer``) is one of them. The one answer to
        "can this process sign?" every door that builds asks before any work (else what it
        stored would be refused by every later load, and it would build forever)."""
        return not self.policy.keys or (self.signer is not None and self.signer.public in self.policy.keys)

    # -- the loader's half ------------------------------------------------------------------
    def get(self, key: str, miss_hint: str = "", wait: bool = True,
            built_here: bool = False) -> Entry:
        """The entry ``key``: local, else pulled through from the remote (module doc) — waiting
        for a live compile lease on it when ``wait`` — and allowed by the trust policy. Raises
        ``CacheMiss`` (with ``miss_hint`` when no tier has it), ``RemoteError`` for damaged or unreachable remote bytes,
        ``TrustError`` for an entry the policy refuses (``UnsafeStoreError``: a store others
        could write). ``built_here``: a key from elsewhere (a saved record,
        ``aotc.load(key=…)``) must name an entry built for this machine and this aotc (else
        ``LoadError``)."""
        self._safe()
        entry = self._get(key, miss_hint, wait)
        if built_here:
            from aotc.lookup.toolchain import check_built_here

            check_built_here(entry, self.local.base / "toolchain")
        return entry

    def _get(self, key: str, miss_hint: str, wait: bool) -> Entry:
        if self.local.has(key):
            return self._checked(self.local.get(key))
        if self.remote is None:
            raise CacheMiss(key, hint=miss_hint or f"the store {self.local.root} has no entry "
                                                   f"{key[:16]}… (set AOTC_REMOTE to pull it)")
        want = Wanted.by_key(key)
        entry = self._pull(want) if not wait else self._pull_or_wait(want)
        if entry is None:
            raise CacheMiss(key, hint=miss_hint or f"neither {self.local.root} nor {self.remote.url} "
                                                   f"has entry {key[:16]}…")
        return entry

    def find(self, manifest: Any, machine: dict[str, Any] | None = None,
             record_miss: bool = True) -> Resolution:
        """What ``manifest`` compiles to on this ``machine`` (default: this one's toolchain
        factors, memoized in the store): resolved in the local tier, else pulled through from the
        remote and resolved again. A local entry that exists but is damaged is reported
        (``Resolution.corrupt``), not replaced from the remote. ``record_miss=False``: a miss that
        stands is left for the caller to count (``Resolution.record_miss``: a build may yet move
        the key onto a hit); a local miss the remote then served is counted here, as always."""
        if machine is None:
            from aotc.lookup.toolchain import machine_factors

            machine = machine_factors(manifest.device, self.local.base / "toolchain")
        return self.find_probe(manifest_probe(manifest, machine), record_miss=record_miss)

    def find_probe(self, probe: Probe, wait: bool = True, record_miss: bool = True) -> Resolution:
        """The current entry behind ``probe``: resolved in the local tier, else pulled through
        from the remote (waiting on a live compile lease when ``wait``) and resolved again."""
        self._safe()
        found = resolve_probe(probe, self.local, record_miss=record_miss)
        if found.entry is None and found.corrupt is None and self.remote is not None:
            want = Wanted.by_probe(probe)
            if (self._pull_or_wait(want) if wait else self._pull(want)) is not None:
                if not record_miss:  # the local tier missed what the remote served: one miss
                    found.record_miss(self.local)
                found = resolve_probe(probe, self.local, record_miss=False)
        if found.entry is not None:
            self._checked(found.entry)
        return found

    # -- the one fleet journey --------------------------------------------------------------
    def get_or_build(self, want: Wanted, build: Callable[[], T]) -> Served[T]:
        """Serve ``want`` (module doc): the local entry, else — under the node's build lease
        (:mod:`aotc.fleet.local_lease`: one process per node goes on, the others wait and find
        its entry here) — the remote's (pulled through), else ``build()`` under the remote's
        compile lease, then pushed. ``build`` stores what it makes with :meth:`put` and returns
        something with the stored ``key``. A store others could write raises
        ``UnsafeStoreError`` first: nothing is served from it or built into it."""
        self._safe()
        entry = self._local(want)
        if entry is not None:
            return Served(entry=entry)
        from aotc.fleet.local_lease import node_single_flight

        def here() -> Served[T] | None:  # the same lookup as the first (its miss counted once)
            found = self._local(want, record_miss=False)
            return None if found is None else Served(entry=found)

        return node_single_flight(self.local, self._lease_id(want), want.what, here,
                                  lambda: self._fetch_or_build(want, build), self.lease_wait,
                                  say=self.progress.note)

    def _fetch_or_build(self, want: Wanted, build: Callable[[], T]) -> Served[T]:
        """The remote's entry (pulled through), else ``build()`` under its compile lease and
        pushed; no remote: ``build()``."""
        if self.remote is None:
            return Served(built=build())
        from aotc.fleet.lease import single_flight

        def fetch() -> Served[T] | None:
            try:
                got = self._pull(want)
            except (RemoteError, TrustError) as e:  # unreachable, damaged or refused
                raise _Refused(e) from e
            return None if got is None else Served(entry=got, pulled=True)

        def build_and_push() -> Served[T]:
            made = build()
            return Served(built=made, pushed=self.push(made.key, want.what))

        try:
            return single_flight(self.remote, self._lease_id(want), want.what, fetch, build_and_push,
                                 self.lease_ttl, self.lease_wait, say=self.progress.note)
        except _Refused as e:
            _LOG.warning("aotc: warning: %s: not taken from %s (%s); building it here", want.what,
                         self.remote.url, e.args[0])
        return build_and_push()

    def put(self, key: str, name: str, blobs: dict[str, Any], factors: dict[str, Any],
            metadata: dict[str, Any]) -> Entry:
        """Store an entry in the local tier — signed in the same transaction when a signing key
        is set, so it is never visible unsigned."""
        self._writable(f"store entry {key[:16]}…")
        return self.local.put(key, name, blobs, factors=factors, metadata=metadata,
                              sign=None if self.signer is None else self.signer.sign)

    def sign(self, key: str) -> str | None:
        """Sign the local entry ``key`` with the signing key, if one is set and has not signed it
        (an entry stored before the key was set); the signer's public key or None."""
        return sign_with(self.local, key, self.signer)

    def push(self, key: str, what: str = "") -> bool | None:
        """Push local entry ``key`` to the remote (None: no remote); a failure is one warning
        (the entry stands here; ``aotc push`` it later), never a failed start."""
        if self.remote is None:
            return None
        from aotc.errors import AotcError
        from aotc.fleet.sync import push_entry

        try:
            self.sign(key)
            push_entry(self.local, self.remote, key, progress=self.progress)
            return True
        except AotcError as e:
            _LOG.warning("aotc: warning: %s: stored here, but the push to %s failed (%s); "
                         "`aotc push` it later", what or f"{key[:16]}…", self.remote.url, e)
            return False

    def publish(self, key: str, name: str, blobs: dict[str, Any], factors: dict[str, Any],
                metadata: dict[str, Any]) -> Entry:
        """The second half of :meth:`get_or_build`'s journey alone — :meth:`put` (signed in its
        transaction) then :meth:`push` (one warning if it fails) — for a file a front door did
        not build under a lease (vLLM's AOT record, written by vLLM; module doc)."""
        entry = self.put(key, name, blobs, factors, metadata)
        self.push(key, name)
        return entry

    # -- the parts ---------------------------------------------------------------------------
    def _local(self, want: Wanted, record_miss: bool = True) -> Entry | None:
        if want.key is not None:
            entry = self.local.get(want.key) if self.local.has(want.key) else None
        else:
            entry = resolve_probe(want.probe, self.local,  # type: ignore[arg-type]  # by_key or by_probe
                                  record_miss=record_miss).entry
        if entry is None:
            return None
        try:
            return self._checked(entry)
        except TrustError as e:  # refused here: the remote may hold a trusted copy, or build it
            _LOG.warning("aotc: warning: %s: the local entry is refused (%s); looking further",
                         want.what, e)
            return None

    def _safe(self) -> None:
        """Raise ``UnsafeStoreError`` unless code may be loaded from the local store (module doc)."""
        enforce_store(self.local, self.policy)

    def _checked(self, entry: Entry) -> Entry:
        """``entry`` if the policy lets it load here: with trusted keys, every entry — local ones
        included — needs a trusted signature before any blob is read (:mod:`aotc.fleet.trust`)."""
        enforce(self.local, entry, self.policy)
        return entry

    def _lease_id(self, want: Wanted) -> str:
        if want.key is not None:
            return want.key
        return want.probe.key  # type: ignore[union-attr]  # by_key or by_probe

    def _pull(self, want: Wanted) -> Entry | None:
        """The remote's entry, pulled into the local tier; None when the remote has none."""
        remote = self.remote
        if remote is None:
            return None
        self._writable(f"pull {want.what} into it from {remote.url}")
        from aotc.fleet import sync

        t = time.perf_counter()
        if want.key is not None:
            try:
                moved = sync.pull_entry(remote, self.local, want.key, self.policy, self.progress)
            except CacheMiss:
                return None
            key = want.key
        else:
            found = sync.pull_for_probe(want.probe, remote, self.local, self.policy, self.progress)
            if found is None:
                return None
            moved, key = found, found.key
        self.pulled_bytes += moved.bytes_moved
        self.pull_seconds += time.perf_counter() - t
        return self._checked(self.local.get(key))  # as the local store holds it now

    def _pull_or_wait(self, want: Wanted) -> Entry | None:
        """:meth:`_pull`, else — when another process holds the compile lease — wait for it."""
        got = self._pull(want)
        if got is None and self.lease_wait > 0 and self.remote is not None:
            from aotc.fleet.lease import wait_for_holder

            got = wait_for_holder(self.remote, self._lease_id(want), want.what,
                                  lambda: self._pull(want), self.lease_wait)
        return got

    def _writable(self, what: str) -> None:
        if self.local.read_only:
            raise StoreReadOnlyError(str(self.local.root), what)


def open_tiered(context: Any, manifest: Any = None, create: bool = False) -> TieredStore:
    """The tiered store a ``context`` (:class:`aotc.context.Context`) names: its ``store`` (a
    ``Store``, a directory, or an ``s3://``/``oci://`` URL that then is the remote in front of
    the default local store; None: ``AOTC_STORE``, else the manifest's ``store`` field) and its
    ``remote``. The local store is created when missing if ``create`` or a remote tier is set."""
    from aotc.lookup.stores import open_store, split_store

    local, rem = split_store(context.store, context.remote, context.settings)
    return TieredStore(open_store(local, manifest, create=create or rem is not None,
                                  settings=context.settings),
                       rem, context.trust, None if context.signing_key is None else context.signer,
                       lease_ttl=context.lease.ttl, lease_wait=context.lease.wait)


def pull_manifest(manifest: Any, remote: Remote, store: Store, trusted: TrustPolicy,
                  progress: Progress | None = None, build: Callable[[], Any] | None = None) -> Transfer | None:
    """``aotc pull MANIFEST``: the remote entry ``manifest`` compiles to on this machine, pulled
    into ``store`` (``aotc.fleet.sync.pull_for_probe``'s transfer); None when the remote has none.
    A remote's entries are not compared before a pull, so where the first look finds nothing and
    ``build`` is given (the manifest's model build) the model is built, the key read again and
    the remote asked again if the build moved it (torchao's ``quantize_`` sets Inductor options
    the key names: :func:`aotc.lookup.resolve.reread_after_build`)."""
    from aotc.fleet import sync
    from aotc.lookup.resolve import reread_after_build
    from aotc.lookup.toolchain import machine_factors

    memo = store.base / "toolchain"
    machine = machine_factors(manifest.device, memo)
    got = sync.pull_for_probe(manifest_probe(manifest, machine), remote, store, trusted, progress)
    if got is None and build is not None:
        build()
        after, moved = reread_after_build(manifest, machine, memo)
        if moved:
            got = sync.pull_for_probe(manifest_probe(manifest, after), remote, store, trusted, progress)
    return got
