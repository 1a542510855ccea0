"""Moving entries between the local store and a remote one (any :class:`aotc.fleet.remote_api.Remote`:
S3, an OCI registry; typed against the protocol, never asking which): ``push_entry``,
``pull_entry``, and the lookup a warm start makes on a local miss (``pull_for_probe``).

Push: every local blob is re-hashed first (damaged bytes are never shipped); each blob is HEAD-ed
and uploaded only when the remote lacks it (re-pushing uploads nothing); the record is written
last, with a conditional PUT (a concurrent pusher of the same key finds it there and keeps it);
then the probe marker and the signatures. Pull: the record is checked (its key is the hash of its
factors) and, under a trust policy, its signatures, before any blob is fetched; every blob is
decompressed into staging and re-hashed, bounded by its recorded size; only then does one
``Store.put`` add the entry. A damaged remote blob is refused and nothing enters the local store.
Needs no torch, except ``pull_for_probe`` (the source files it hashes).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotc.cache import CacheMiss, Entry, Store, blobio
from aotc.errors import DamagedRemoteEntry, MissingObject, OversizedObject, RemoteError
from aotc.fleet.remote_api import Remote
from aotc.fleet.trust import NO_KEYS, TrustPolicy, enforce_payload, valid_signatures
from aotc.progress import Progress
from aotc.records.entry_record import build_record, parse_record, put_staged, same_content, stage_verified
from aotc.records.jsonable import FieldsAsJson

MAX_SIGNERS = 64
TRANSFER_THREADS = 8


@dataclass(frozen=True)
class Transfer(FieldsAsJson):
    """What a push or pull did (``moved`` False: the other side already had the entry)."""

    direction: str
    key: str
    name: str
    remote: str
    blobs: int
    blobs_moved: int
    bytes_moved: int
    moved: bool
    note: str = ""


def remote_entry(remote: Remote, key: str) -> Entry | None:
    """The remote's entry ``key`` (None when absent); ``DamagedRemoteEntry`` when its record is
    damaged."""
    fix = f"run `aotc --store {remote.url} verify --repair`, then push it again"
    try:
        raw = remote.get_bytes(remote.entry_name(key))
    except OversizedObject as e:
        raise DamagedRemoteEntry(f"{e}; {fix}") from None
    if raw is None:
        return None
    try:
        entry, _ = parse_record(raw)
    except ValueError as e:
        raise DamagedRemoteEntry(f"{remote.url}: the record of {key[:16]}… is damaged ({e}); "
                                 f"{fix}") from None
    if entry.key != key:
        raise DamagedRemoteEntry(f"{remote.url}: {remote.entry_name(key)} holds the record of "
                                 f"another key ({entry.key[:16]}…); {fix}")
    return entry


def remote_signatures(remote: Remote, key: str) -> dict[str, str]:
    """The signatures stored beside remote entry ``key``: public key -> signature (hex). Objects
    that cannot be a signature (a name that is not a key, more than a few hundred bytes, past
    the first ``MAX_SIGNERS``) are left out: checking them is the trust policy's job, and junk
    must not block a pull."""
    out: dict[str, str] = {}
    for obj in remote.list(f"signatures/{key}/"):
        public = obj.name.rsplit("/", 1)[-1]
        if len(out) >= MAX_SIGNERS or not blobio.is_digest(public) or obj.size > 512:
            continue
        try:
            raw = remote.get_bytes(obj.name, limit=512)
        except OversizedObject:
            continue
        if raw is not None:
            out[public] = raw.decode("ascii", "replace").strip()
    return out


def _publish_markers(store: Store, remote: Remote, entry: Entry) -> None:
    """The probe marker and this store's signatures of ``entry`` (each only when missing).
    Call only when the remote's record is ``entry``'s content: a signature covers the digests."""
    probe = entry.metadata.get("probe")
    if blobio.is_digest(probe) and remote.head(remote.probe_name(probe, entry.key)) is None:
        remote.put(remote.probe_name(probe, entry.key), b"")
    held = remote_signatures(remote, entry.key)
    for public, sig in store.signatures(entry.key).items():
        if held.get(public) != sig:
            remote.put(remote.signature_name(entry.key, public), sig.encode())


def push_entry(store: Store, remote: Remote, key: str, force: bool = False,
               progress: Progress | None = None) -> Transfer:
    """Push local entry ``key`` to ``remote`` (see module doc) with the signatures the local
    store holds (the caller signs first: ``aotc.fleet.trust.sign_with``). ``force`` re-uploads
    every blob and replaces the remote's record (the repair for a damaged remote entry)."""
    progress = progress or Progress(quiet=True)
    entry = store.get(key, record=False)
    for role in entry.blobs:  # never ship damaged bytes (marks the entry bad if so)
        store.verify_blob(entry, role)
    digests = sorted({b.digest for b in entry.blobs.values()})
    try:
        held = None if force else remote_entry(remote, key)
    except DamagedRemoteEntry:
        held, force = None, True  # replaced below, every blob uploaded again
    if held is not None:
        return _kept(store, remote, entry, held, len(digests))
    remote.learn_local({d: store.blob_path(d) for d in digests})  # a registry: the layer digests
    # Each blob's size as the remote holds it goes into the record: a pull refuses more bytes.
    remote_sizes = dict(zip(digests, _parallel(
        lambda d: None if force else remote.head(remote.blob_name(d)), digests)))
    missing = [d for d, size in remote_sizes.items() if size is None]
    sizes = {d: remote_sizes[d] or _local_size(store, d) for d in digests}
    total, done, lock = sum(sizes[d] for d in missing), 0, threading.Lock()

    def on_bytes(n: int) -> None:
        nonlocal done
        with lock:  # s3transfer calls back from its threads
            done += n
            progress.transfer(done, total, f"{entry.name} {key[:12]}")

    _parallel(lambda d: remote.upload(remote.blob_name(d), store.blob_path(d), on_bytes), missing)
    if force:  # signatures of the record being replaced would not match the new one
        for obj in remote.list(f"signatures/{key}/"):
            remote.delete(obj.name)
    record = json.dumps(build_record(entry, sizes), sort_keys=True, indent=1).encode()
    if not remote.put(remote.entry_name(key), record, if_absent=not force):
        held = remote_entry(remote, key)  # a concurrent push stored it first
        if held is not None:
            kept = _kept(store, remote, entry, held, len(digests))
            return Transfer("push", key, entry.name, remote.url, len(digests), len(missing),
                            sum(sizes[d] for d in missing), False,
                            "a concurrent push stored this key first; " + (kept.note or "kept it"))
    _publish_markers(store, remote, entry)
    return Transfer("push", key, entry.name, remote.url, len(digests), len(missing),
                    sum(sizes[d] for d in missing), True)


def _kept(store: Store, remote: Remote, entry: Entry, held: Entry, blobs: int) -> Transfer:
    """The remote already holds key ``entry.key`` as ``held``: add our markers and signatures
    only when it is the same content (a signature of another build would not verify there)."""
    same = store.signing_payload(held) == store.signing_payload(entry)
    if same:
        _publish_markers(store, remote, entry)
    note = "" if same else ("the remote holds another build of this key; kept it (--force "
                            "replaces it)")
    return Transfer("push", entry.key, entry.name, remote.url, blobs, 0, 0, False, note)


def _parallel(fn: Callable[[str], Any], items: list[str]) -> list[Any]:
    """``fn`` over ``items`` in up to ``TRANSFER_THREADS`` threads (each blob is one request: a
    round trip dominates a small one; zstd and sha256 release the GIL), results in order. The
    first error is raised once every started call has ended, so nothing is left writing."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(max_workers=min(TRANSFER_THREADS, len(items))) as pool:
        futures = [pool.submit(fn, i) for i in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:  # after a failure, start nothing more
            f.cancel()
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]  # the future has failed: exception() is an exception
    return [f.result() for f in futures]


def _local_size(store: Store, digest: str) -> int:
    try:
        return store.blob_path(digest).stat().st_size
    except OSError:
        raise RemoteError(f"local blob {digest[:16]}… vanished while pushing (a concurrent "
                          "`aotc gc`?); push again") from None


class _Counting:
    """A read-only stream that reports the bytes read through it and refuses more than
    ``limit`` (the compressed size the record gives: padding is never downloaded)."""

    def __init__(self, raw: Any, on_bytes: Callable[[int], None], limit: int) -> None:
        self.raw, self.on_bytes, self.left = raw, on_bytes, limit

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(self.left + 1 if n < 0 else min(n, self.left + 1))
        self.left -= len(data)
        if self.left < 0:
            raise blobio.BlobCorrupt("the server sends more bytes than its record gives it")
        if data:
            self.on_bytes(len(data))
        return data

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> _Counting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pull_entry(remote: Remote, store: Store, key: str, trusted: TrustPolicy = NO_KEYS,
               progress: Progress | None = None, entry: Entry | None = None) -> Transfer:
    """Pull remote entry ``key`` into ``store`` (see module doc): ``CacheMiss`` when the remote
    has no such entry, ``RemoteError`` for damaged remote bytes, ``TrustError`` under a policy.
    ``entry``: its record, when the caller has just read it (``find_remote_entry``)."""
    progress = progress or Progress(quiet=True)
    entry = entry if entry is not None and entry.key == key else remote_entry(remote, key)
    if entry is None:
        raise CacheMiss(key, hint=f"{remote.url} has no entry {key[:16]}…; push it there first "
                                  "(`aotc push` on a machine that compiled it)")
    sigs = remote_signatures(remote, key)
    payload = store.signing_payload(entry)
    enforce_payload(payload, sigs, trusted, entry, crossing=remote.url)  # before any blob
    sigs = valid_signatures(payload, sigs)  # an invalid one is never stored
    digests = {b.digest: b.size for b in entry.blobs.values()}
    if same_content(store, entry):  # its signatures only where they cover the record held here
        if store.signing_payload(store.get(key, record=False)) == payload:
            for public, sig in sigs.items():
                store.add_signature(key, public, sig)
        return Transfer("pull", key, entry.name, remote.url, len(digests), 0, 0, False)
    need, free = sum(digests.values()), shutil.disk_usage(store.tmp_dir).free
    if need > free:
        raise RemoteError(f"{remote.url}: entry {key[:16]}… decompresses to {need} bytes, more "
                          f"than the {free} free beside the store {store.root}")
    where = f"{remote.url}: {entry.name} {key[:16]}…"
    staged: dict[str, Path] = {}
    done, fetch = 0, []
    try:
        for d in digests:  # blobs this store already has (shared with another entry): no download
            if (path := _stage_local(store, d, digests[d])) is not None:
                staged[d] = path
        fetch = sorted(set(digests) - set(staged))
        stored = {b.digest: b.stored_size for b in entry.blobs.values()}
        total = sum(stored[d] for d in fetch)

        lock = threading.Lock()

        def on_bytes(n: int) -> None:
            nonlocal done
            with lock:
                done += n
                progress.transfer(done, max(total, done), f"{entry.name} {key[:12]}")

        def fetch_one(d: str) -> None:
            staged[d] = _download(remote, store, d, digests[d], stored[d], on_bytes, where)

        _parallel(fetch_one, fetch)
        if fetch and done != total:  # the record's sizes were not the server's: close the bar
            progress.transfer(done, done, f"{entry.name} {key[:12]}")
        for path in staged.values():  # fresh mtimes: `gc` spares staging files in use
            os.utime(path)
        if not put_staged(store, entry, staged, sigs):  # the signatures in the same transaction
            raise RemoteError(f"{where}: a staged blob changed before it was stored; nothing "
                              "was pulled, try again")
    except OSError as e:
        raise RemoteError(f"{where}: cannot write the local store {store.root} ({e}); nothing "
                          "was pulled") from None
    finally:
        for p in staged.values():
            p.unlink(missing_ok=True)
    return Transfer("pull", key, entry.name, remote.url, len(digests), len(fetch), done, True)


def _download(remote: Remote, store: Store, digest: str, size: int, stored_size: int,
              on_bytes: Callable[[int], None], where: str) -> Path:
    """One remote blob into a verified staging file (see ``stage_verified``)."""
    try:
        body, length = remote.open(remote.blob_name(digest))
    except MissingObject:
        raise RemoteError(f"{where} is incomplete: blob {digest[:16]}… is missing; run "
                          f"`aotc --store {remote.url} verify --repair`, then push it again") from None
    try:
        if length > stored_size:
            body.close()
            raise blobio.BlobCorrupt(f"{length} bytes on the server, its record says {stored_size}")
        return stage_verified(store, _Counting(body, on_bytes, stored_size), digest, size)  # type: ignore[arg-type]  # reads like a file
    except blobio.BlobCorrupt as e:
        raise RemoteError(f"{where}: blob {digest[:16]}… is damaged ({e}); refused, nothing was "
                          "pulled; re-push it with `aotc push --force` from a good store") from None
    except remote.errors as e:
        raise RemoteError(f"{where}: download of blob {digest[:16]}… broke off ({e}); nothing "
                          "was pulled, try again") from None


def _stage_local(store: Store, digest: str, size: int) -> Path | None:
    """A blob the local store already has (another entry shares it), staged without a download;
    None when it is absent or damaged (the download replaces it)."""
    try:
        src = open(store.blob_path(digest), "rb")
    except FileNotFoundError:
        return None
    try:
        return stage_verified(store, src, digest, size)
    except blobio.BlobCorrupt:
        return None


def _safe_code_paths(code: Any) -> bool:
    """A remote record's ``code`` factor names only relative ``.py`` paths inside the import
    path (no absolute paths, no ``..``): hashing them reads nothing else on this machine."""
    if not isinstance(code, dict):
        return False
    for rel in code:
        parts = str(rel).split("/")
        if (not str(rel).endswith(".py") or str(rel).startswith("/") or "\\" in str(rel)
                or any(p in ("", ".", "..") for p in parts)):
            return False
    return True


def find_remote_entry(want: Any, remote: Remote, trusted: TrustPolicy = NO_KEYS) -> Entry | None:
    """The remote entry a lookup ``want`` (:class:`aotc.lookup.resolve.Probe`: what a manifest
    compiles to, or a precompiled function, on this machine) finds: the newest behind its probe
    marker whose recorded source files still hash the same here. None when there is none; the
    damage found (``DamagedRemoteEntry``) when the only candidates are damaged. Under a trust
    policy a candidate's signatures are checked before its source paths are looked at."""
    from aotc.fleet.trust import payload_state

    probe = want.key
    markers = sorted(remote.list(f"probes/{probe}/"), key=lambda o: o.modified, reverse=True)
    damage: DamagedRemoteEntry | None = None
    untrusted = 0
    for marker in markers:
        key = marker.name.rsplit("/", 1)[-1]
        if not blobio.is_digest(key):
            continue
        try:
            entry = remote_entry(remote, key)
        except DamagedRemoteEntry as e:
            damage = damage or e  # another candidate may do; else this is the answer
            continue
        if entry is None or entry.metadata.get("probe") != probe:
            continue
        if not _safe_code_paths(entry.factors.get("code", {})):
            continue
        if not trusted.allow_unsigned and payload_state(
                Store.signing_payload(entry), remote_signatures(remote, key), trusted) != "trusted":
            untrusted += 1
            continue
        if want.unchanged(key, entry.factors):
            return entry
    if untrusted:
        from aotc.fleet.trust import TRUST_ENV, UNSIGNED_ENV, TrustError

        raise TrustError(f"{remote.url}: {untrusted} entr{'y' if untrusted == 1 else 'ies'} of "
                         f"{want.name} for this machine, none signed by a trusted key; refused "
                         f"(sign where it is built: AOTC_SIGNING_KEY or `aotc sign`, then `aotc "
                         f"push`; trust that key with {TRUST_ENV}; or {UNSIGNED_ENV}=1 to accept "
                         "unsigned entries)")
    if damage is not None:
        raise damage
    return None


def pull_for_probe(want: Any, remote: Remote, store: Store, trusted: TrustPolicy = NO_KEYS,
                   progress: Progress | None = None) -> Transfer | None:
    """Pull the remote entry the lookup ``want`` finds (:func:`find_remote_entry`); None when
    the remote has none (a miss there too)."""
    entry = find_remote_entry(want, remote, trusted)
    if entry is None:
        return None
    return pull_entry(remote, store, entry.key, trusted, progress, entry=entry)


def remote_key_for(remote: Remote, text: str) -> str:
    """A full remote key from a key or a unique prefix of one (>= 8 hex chars)."""
    from aotc.lookup.explain import match_key

    def keys_with_prefix(prefix: str) -> list[str]:
        names = (o.name[len("entries/"):] for o in remote.list(f"entries/{prefix}"))
        return [n[:-len(".json")] for n in names
                if n.endswith(".json") and blobio.is_digest(n[:-len(".json")])]

    return match_key(text, keys_with_prefix, remote.url, f"`aotc --store {remote.url} inspect cache`")
