"""Relocatable bundles: one store entry as one file (``aotc export``) and back (``aotc import``).

Format: an uncompressed POSIX tar (the blobs are zstd already), members in this order::

    aotc-bundle.json   {"format": 1, "key", "name", "factors", "metadata",
                        "blobs": {role: {"digest", "size", "stored_size"}},
                        "signatures": {public key: signature}}
    blobs/<sha256>     each distinct blob exactly as the store keeps it (zstd)

No absolute paths, no links, fixed owner and times (the same entry exports to the same bytes).
``import_bundle`` reads the record first, then refuses — before anything enters the store — any
member that is not a regular file with a name it expects (path traversal, links, devices),
a duplicate, a member larger than the record says, a truncated file, a blob whose decompressed
bytes do not hash to its name (decompression is bounded by the recorded size) and, under a trust
policy, an entry not signed by a trusted key. Importing an entry the store already holds is a no-op.
Needs no torch.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from aotc.cache import Store, blobio
from aotc.errors import BundleError
from aotc.fleet.trust import NO_KEYS, TrustPolicy, enforce_payload, valid_signatures
from aotc.records.entry_record import build_record, parse_record, put_staged, same_content, stage_verified
from aotc.records.jsonable import FieldsAsJson

RECORD = "aotc-bundle.json"
MAX_RECORD = 16 << 20


@dataclass(frozen=True)
class BundleResult(FieldsAsJson):
    """What an export or import did."""

    key: str
    name: str
    path: str
    blobs: int
    bytes: int
    imported: bool = False  # import: False when the store already held the entry


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uid, info.gid = size, 0o644, 0, 0, 0
    return info


def export_entry(store: Store, key: str, out: str | os.PathLike[str]) -> BundleResult:
    """Write entry ``key`` of ``store`` (every blob verified first) to the bundle file ``out``."""
    entry = store.get(key, record=False)
    for role in entry.blobs:  # never ship damaged bytes (marks the entry bad if so)
        store.verify_blob(entry, role)
    out = Path(out)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    digests = sorted({b.digest for b in entry.blobs.values()})
    files = {d: open(store.blob_path(d), "rb") for d in digests}  # noqa: SIM115 - closed below
    try:
        stored = {d: os.fstat(f.fileno()).st_size for d, f in files.items()}  # what is written
        record = {**build_record(entry, stored), "signatures": store.signatures(entry.key)}
        data = json.dumps(record, sort_keys=True, indent=1).encode()
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_info(RECORD, len(data)), io.BytesIO(data))
            for digest in digests:
                tar.addfile(_info(f"blobs/{digest}", stored[digest]), files[digest])
        os.replace(partial, out)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise BundleError(f"cannot write bundle {out}: {e}") from e
    finally:
        for f in files.values():
            f.close()
    return BundleResult(entry.key, entry.name, str(out), len(digests), out.stat().st_size)


def import_bundle(store: Store, path: str | os.PathLike[str],
                  trusted: TrustPolicy = NO_KEYS) -> BundleResult:
    """Verify the bundle at ``path`` completely, then add its entry to ``store`` (see module doc)."""
    where = str(path)
    try:
        tar = tarfile.open(path, "r:")
    except (OSError, tarfile.TarError) as e:
        raise BundleError(f"{where}: not an aotc bundle ({e})") from None
    staged: dict[str, Path] = {}
    try:
        with tar:
            first = _next(tar, where)
            if first is None or first.name != RECORD or not first.isreg() or first.size > MAX_RECORD:
                raise BundleError(f"{where}: the first member must be {RECORD} (at most "
                                  f"{MAX_RECORD >> 20} MiB); is this a bundle from `aotc export`?")
            try:
                entry, sigs = parse_record(_read_all(tar, first, where))
            except ValueError as e:
                raise BundleError(f"{where}: {RECORD} is not a valid bundle record ({e})") from None
            sizes = {b.digest: (b.size, b.stored_size) for b in entry.blobs.values()}
            payload = store.signing_payload(entry)
            enforce_payload(payload, sigs, trusted, entry, crossing=where)  # before any blob
            sigs = valid_signatures(payload, sigs)  # a bad one is never stored
            if same_content(store, entry):  # the same content: only add signatures that cover it
                if store.signing_payload(store.get(entry.key, record=False)) == payload:
                    for public, sig in sigs.items():
                        store.add_signature(entry.key, public, sig)
                return BundleResult(entry.key, entry.name, where, len(sizes), 0, imported=False)
            need = sum(u for u, _s in sizes.values())
            free = shutil.disk_usage(store.tmp_dir).free
            if need > free:  # sizes are the record's word: never decompress past the disk
                raise BundleError(f"{where}: its blobs decompress to {need} bytes, more than the "
                                  f"{free} free beside the store")
            while (member := _next(tar, where)) is not None:
                digest = member.name.removeprefix("blobs/")
                if member.name != f"blobs/{digest}" or digest not in sizes:
                    raise BundleError(f"{where}: unexpected member {member.name!r} (only {RECORD} "
                                      "and blobs/<sha256> of the record are allowed)")
                if not member.isreg():
                    raise BundleError(f"{where}: member {member.name!r} is a link or special file")
                if digest in staged:
                    raise BundleError(f"{where}: member {member.name!r} appears twice")
                if member.size > sizes[digest][1]:
                    raise BundleError(f"{where}: member {member.name!r} is {member.size} bytes, "
                                      f"larger than the {sizes[digest][1]} its record says")
                staged[digest] = _stage(store, tar, member, digest, sizes[digest][0], where)
            missing = sorted(set(sizes) - set(staged))
            if missing:
                raise BundleError(f"{where}: {len(missing)} blob(s) missing, e.g. {missing[0][:16]}… "
                                  "(a truncated or incomplete bundle)")
            if not put_staged(store, entry, staged, sigs):  # a staging file changed under us
                raise BundleError(f"{where}: a staged blob changed before it was stored; "
                                  "nothing was imported, try again")
            total = sum(s for _u, s in sizes.values())
            return BundleResult(entry.key, entry.name, where, len(sizes), total, imported=True)
    finally:
        for p in staged.values():
            p.unlink(missing_ok=True)


def _next(tar: tarfile.TarFile, where: str) -> tarfile.TarInfo | None:
    try:
        return tar.next()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleError(f"{where}: truncated or damaged bundle ({e})") from None


def _read_all(tar: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> bytes:
    f = tar.extractfile(member)
    try:
        data = f.read() if f is not None else b""
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleError(f"{where}: truncated bundle ({e})") from None
    if len(data) != member.size:
        raise BundleError(f"{where}: truncated bundle ({member.name} is short)")
    return data


def _stage(store: Store, tar: tarfile.TarFile, member: tarfile.TarInfo, digest: str, size: int,
           where: str) -> Path:
    """Decompress one blob member into a staging file, verified as the store verifies its own
    blobs (``blobio.stream_blob``: bounded by ``size``, hashed); the file is the input of
    ``Store.put``."""
    try:
        return stage_verified(store, tar.extractfile(member), digest, size)  # type: ignore[arg-type]  # a regular member: extractfile gives a stream
    except blobio.BlobCorrupt as e:
        raise BundleError(f"{where}: blob {digest[:16]}… refused ({e}): tampered or damaged; "
                          "nothing was imported") from None
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleError(f"{where}: blob {digest[:16]}… is truncated or damaged ({e})") from None
