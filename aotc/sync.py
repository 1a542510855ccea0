"""Moving entries between the local store and a remote one (``aotc.remote``): ``push_entry``,
``pull_entry``, and the lookup a warm start makes on a local miss (``pull_for_manifest``).

Push: every local blob is re-hashed first (damaged bytes are never shipped); each blob is HEAD-ed
and uploaded only when the remote lacks it (re-pushing uploads nothing); the record is written
last, with a conditional PUT (a concurrent pusher of the same key finds it there and keeps it);
then the probe marker and the signatures. Pull: the record is checked (its key is the hash of its
factors) and, under a trust policy, its signatures, before any blob is fetched; every blob is
decompressed into staging and re-hashed, bounded by its recorded size; only then does one
``Store.put`` add the entry. A damaged remote blob is refused and nothing enters the local store.
Needs no torch, except ``pull_for_manifest`` (the key factors of this machine).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aotc.cache import CacheMiss, Entry, Store, blobio
from aotc.entry_record import build_record, parse_record, put_staged, same_content, stage_verified
from aotc.progress import Progress
from aotc.remote import RemoteError, S3Remote
from aotc.trust import enforce_payload, valid_signatures


class DamagedRemoteEntry(RemoteError):
    """A remote entry's record does not parse or names another key."""


@dataclass(frozen=True)
class Transfer:
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

    def to_json(self) -> dict[str, Any]:
        return {"direction": self.direction, "key": self.key, "name": self.name,
                "remote": self.remote, "blobs": self.blobs, "blobs_moved": self.blobs_moved,
                "bytes_moved": self.bytes_moved, "moved": self.moved, "note": self.note}


def _digests(entry: Entry) -> dict[str, str]:
    return {r: b.digest for r, b in entry.blobs.items()}


def remote_entry(remote: S3Remote, key: str) -> Entry | None:
    """The remote's entry ``key`` (None when absent); ``RemoteError`` when its record is damaged."""
    raw = remote.get_bytes(remote.entry_name(key))
    if raw is None:
        return None
    try:
        entry, _ = parse_record(raw)
    except ValueError as e:
        raise DamagedRemoteEntry(f"{remote.url}: the record of {key[:16]}… is damaged ({e}); run "
                          f"`aotc --store {remote.url} verify --repair`, then push it again") from None
    if entry.key != key:
        raise DamagedRemoteEntry(f"{remote.url}: {remote.entry_name(key)} holds the record of another "
                          f"key ({entry.key[:16]}…); run `aotc --store {remote.url} verify --repair`")
    return entry


def remote_signatures(remote: S3Remote, key: str) -> dict[str, str]:
    """The signatures stored beside remote entry ``key``: public key -> signature (hex)."""
    out = {}
    for obj in remote.list(f"signatures/{key}/"):
        public = obj.name.rsplit("/", 1)[-1]
        raw = remote.get_bytes(obj.name, limit=4096)
        if raw is not None:
            out[public] = raw.decode("ascii", "replace").strip()
    return out


def _publish_markers(store: Store, remote: S3Remote, entry: Entry) -> None:
    """The probe marker and this store's signatures of ``entry`` (each only when missing)."""
    probe = entry.metadata.get("probe")
    if blobio.is_digest(probe) and remote.head(remote.probe_name(probe, entry.key)) is None:
        remote.put(remote.probe_name(probe, entry.key), b"")
    held = remote_signatures(remote, entry.key)
    for public, sig in store.signatures(entry.key).items():
        if held.get(public) != sig:
            remote.put(remote.signature_name(entry.key, public), sig.encode())


def push_entry(store: Store, remote: S3Remote, key: str, force: bool = False,
               progress: Progress | None = None) -> Transfer:
    """Push local entry ``key`` to ``remote`` (see module doc). ``force`` re-uploads every blob
    and replaces the remote's record (the repair for a damaged remote entry)."""
    progress = progress or Progress(quiet=True)
    entry = store.get(key, record=False)
    for role in entry.blobs:  # never ship damaged bytes (marks the entry bad if so)
        store.verify_blob(entry, role)
    digests = sorted({b.digest for b in entry.blobs.values()})
    try:
        held = None if force else remote_entry(remote, key)
    except DamagedRemoteEntry:
        held, force = None, True  # replaced below, with every blob checked
    if held is not None:
        _publish_markers(store, remote, entry)
        note = "" if _digests(held) == _digests(entry) else \
            "the remote holds another build of this key; kept it (--force replaces it)"
        return Transfer("push", key, entry.name, remote.url, len(digests), 0, 0, False, note)
    missing = [d for d in digests if force or remote.head(remote.blob_name(d)) is None]
    sizes = {d: _local_size(store, d) for d in digests}
    total, done = sum(sizes[d] for d in missing), 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        progress.transfer(done, total, f"{entry.name} {key[:12]}")

    for d in missing:
        remote.upload(remote.blob_name(d), store.blob_path(d), on_bytes)
    record = json.dumps(build_record(entry, sizes), sort_keys=True, indent=1).encode()
    created = remote.put(remote.entry_name(key), record, if_absent=not force)
    _publish_markers(store, remote, entry)
    note = "" if created else "a concurrent push stored this key first; kept it"
    return Transfer("push", key, entry.name, remote.url, len(digests), len(missing),
                    sum(sizes[d] for d in missing), True, note)


def _local_size(store: Store, digest: str) -> int:
    try:
        return store.blob_path(digest).stat().st_size
    except OSError:
        raise RemoteError(f"local blob {digest[:16]}… vanished while pushing (a concurrent "
                          "`aotc gc`?); push again") from None


class _Counting:
    """A read-only stream that reports the bytes read through it."""

    def __init__(self, raw: Any, on_bytes: Callable[[int], None]) -> None:
        self.raw, self.on_bytes = raw, on_bytes

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.on_bytes(len(data))
        return data

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> "_Counting":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pull_entry(remote: S3Remote, store: Store, key: str, trusted: frozenset[str] = frozenset(),
               progress: Progress | None = None) -> Transfer:
    """Pull remote entry ``key`` into ``store`` (see module doc): ``CacheMiss`` when the remote
    has no such entry, ``RemoteError`` for damaged remote bytes, ``TrustError`` under a policy."""
    progress = progress or Progress(quiet=True)
    entry = remote_entry(remote, key)
    if entry is None:
        raise CacheMiss(key, hint=f"{remote.url} has no entry {key[:16]}…; push it there first "
                                  "(`aotc push` on a machine that compiled it)")
    sigs = remote_signatures(remote, key)
    payload = store.signing_payload(entry)
    enforce_payload(payload, sigs, trusted, entry)  # before any blob
    sigs = valid_signatures(payload, sigs)  # an invalid one is never stored
    digests = {b.digest: b.size for b in entry.blobs.values()}
    if same_content(store, entry):
        for public, sig in sigs.items():
            store.add_signature(key, public, sig)
        return Transfer("pull", key, entry.name, remote.url, len(digests), 0, 0, False)
    need, free = sum(digests.values()), shutil.disk_usage(store.tmp_dir).free
    if need > free:
        raise RemoteError(f"{remote.url}: entry {key[:16]}… decompresses to {need} bytes, more "
                          f"than the {free} free beside the store {store.root}")
    staged: dict[str, Path] = {}
    done = 0
    try:
        for d in digests:  # blobs this store already has (shared with another entry): no download
            if (path := _stage_local(store, d, digests[d])) is not None:
                staged[d] = path
        fetch = sorted(set(digests) - set(staged))
        stored = {b.digest: b.stored_size for b in entry.blobs.values()}
        total = sum(stored[d] for d in fetch)

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            progress.transfer(done, max(total, done), f"{entry.name} {key[:12]}")

        for d in fetch:
            body, _length = remote.open(remote.blob_name(d))
            try:
                staged[d] = stage_verified(store, _Counting(body, on_bytes), d, digests[d])
            except blobio.BlobCorrupt as e:
                raise RemoteError(
                    f"{remote.url}: blob {d[:16]}… of {entry.name} {key[:16]}… is damaged ({e}); "
                    "refused, nothing was pulled; re-push it with `aotc push --force` from a good "
                    "store") from None
            except (OSError, remote.errors) as e:
                raise RemoteError(f"{remote.url}: download of blob {d[:16]}… broke off ({e}); "
                                  "nothing was pulled, try again") from None
        if fetch and done != total:  # the record's sizes were not the server's: close the bar
            progress.transfer(done, done, f"{entry.name} {key[:12]}")
        if not put_staged(store, entry, staged):
            raise RemoteError(f"{remote.url}: a staged blob changed before it was stored; nothing "
                              "was pulled, try again")
        for public, sig in sigs.items():
            store.add_signature(key, public, sig)
    finally:
        for p in staged.values():
            p.unlink(missing_ok=True)
    return Transfer("pull", key, entry.name, remote.url, len(digests), len(fetch), done, True)


def _stage_local(store: Store, digest: str, size: int) -> Path | None:
    """A blob the local store already has (another entry shares it), staged without a download;
    None when it is absent or damaged."""
    try:
        return stage_verified(store, open(store.blob_path(digest), "rb"), digest, size)
    except (OSError, blobio.BlobCorrupt):
        return None


def find_remote_entry(manifest: Any, remote: S3Remote, machine: dict[str, Any]) -> Entry | None:
    """The remote entry ``manifest`` compiles to on this machine (``machine``:
    ``aotc.toolchain.machine_factors``): the newest behind the manifest's probe marker whose
    recorded source files still hash the same here. None when there is none."""
    from aotc.key import compute_key
    from aotc.resolve import base_factors, full_factors, hash_sources

    base = base_factors(manifest, machine)
    probe = compute_key(base)
    markers = sorted(remote.list(f"probes/{probe}/"), key=lambda o: o.modified, reverse=True)
    for marker in markers:
        key = marker.name.rsplit("/", 1)[-1]
        if not blobio.is_digest(key):
            continue
        try:
            entry = remote_entry(remote, key)
        except DamagedRemoteEntry:
            continue  # `verify` reports it; another candidate may do
        if entry is None or entry.metadata.get("probe") != probe:
            continue
        code = entry.factors.get("code", {})
        if isinstance(code, dict) and compute_key(full_factors(base, hash_sources(code, manifest))) == key:
            return entry
    return None


def pull_for_manifest(manifest: Any, remote: S3Remote, store: Store, machine: dict[str, Any],
                      trusted: frozenset[str] = frozenset(),
                      progress: Progress | None = None) -> Transfer | None:
    """Pull the remote entry ``manifest`` compiles to on this machine; None when the remote has
    none (a miss there too)."""
    entry = find_remote_entry(manifest, remote, machine)
    if entry is None:
        return None
    return pull_entry(remote, store, entry.key, trusted, progress)


def remote_key_for(remote: S3Remote, text: str) -> str:
    """A full remote key from a key or a unique prefix of one (>= 8 hex chars)."""
    from aotc.errors import InputError

    text = text.strip().lower()
    if len(text) < 8 or any(c not in "0123456789abcdef" for c in text):
        raise InputError(f"{text!r} is neither a manifest file nor a key (>= 8 hex chars)")
    found = [o.name[len("entries/"):-len(".json")] for o in remote.list(f"entries/{text}")
             if o.name.endswith(".json")]
    if len(found) != 1:
        raise InputError(f"{'no' if not found else len(found)} entries of {remote.url} match "
                         f"{text!r}; `aotc --store {remote.url} inspect cache` lists them")
    return found[0]
