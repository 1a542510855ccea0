"""Streaming blob I/O: compress + hash into a staging file, decompress + re-hash out of one.

A blob is named by the sha256 of its UNCOMPRESSED bytes and stored zstd-compressed. Both
directions stream in fixed-size chunks, so a 1 GiB artifact never needs more than a few MiB of RAM.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard

CHUNK = 1 << 20  # 1 MiB
ZSTD_LEVEL = 3

BlobSource = bytes | bytearray | memoryview | os.PathLike | str


@dataclass(frozen=True)
class StagedBlob:
    """A compressed blob written to a staging file, not yet in the store."""

    digest: str
    size: int
    stored_size: int
    path: Path


class BlobCorrupt(Exception):
    """Internal: a stored blob fails to decompress or to hash to its name (mapped to
    ``CorruptedCacheError`` by the store, which knows the entry)."""


def is_digest(value: object) -> bool:
    """True when ``value`` is a lowercase hex sha256 (safe to use in a path)."""
    return (
        isinstance(value, str)
        and len(value) == 64
        and all(c in "0123456789abcdef" for c in value)
    )


def _open_source(source: BlobSource) -> BinaryIO:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(source)
    return open(os.fspath(source), "rb")


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename into it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def stage_blob(source: BlobSource, staging_dir: Path, level: int = ZSTD_LEVEL) -> StagedBlob:
    """Compress ``source`` (bytes or a file path) into a new file under ``staging_dir``, hashing the
    uncompressed bytes on the way; the file is fsynced before this returns."""
    hasher = hashlib.sha256()
    size = 0
    fd_path = staging_dir / f"blob-{os.getpid()}-{os.urandom(6).hex()}.zst"
    cctx = zstandard.ZstdCompressor(level=level)
    with _open_source(source) as src, open(fd_path, "wb") as raw:
        try:
            with cctx.stream_writer(raw, closefd=False) as writer:
                while True:
                    chunk = src.read(CHUNK)
                    if not chunk:
                        break
                    hasher.update(chunk)
                    size += len(chunk)
                    writer.write(chunk)
            raw.flush()
            os.fsync(raw.fileno())
        except BaseException:
            raw.close()
            fd_path.unlink(missing_ok=True)
            raise
    return StagedBlob(hasher.hexdigest(), size, fd_path.stat().st_size, fd_path)


def stream_blob(
    blob_path: Path | BinaryIO, digest: str, expected_size: int | None,
    sink: Callable[[bytes], object],
) -> int:
    """Decompress ``blob_path`` (a file, or an open binary stream: a bundle member) chunk by chunk
    into ``sink`` while re-hashing; raise ``BlobCorrupt`` when the file is missing, unreadable,
    truncated, decompresses beyond ``expected_size`` (checked as it goes: a zstd bomb stops
    early), or hashes to anything but ``digest``.

    ``sink`` sees bytes before the final hash check: callers must write to a staging place and only
    publish after this returns (``read_blob_bytes`` and the store's extract do)."""
    hasher = hashlib.sha256()
    total = 0
    dctx = zstandard.ZstdDecompressor()
    if isinstance(blob_path, (str, os.PathLike)):
        try:
            raw: BinaryIO = open(blob_path, "rb")
        except FileNotFoundError as exc:
            raise BlobCorrupt("blob file is missing") from exc
    else:
        raw = blob_path
    # Only the blob's own faults become BlobCorrupt; an error of the sink (disk full while
    # writing the copy) or of the OS propagates as-is and never marks a good entry bad.
    with raw, dctx.stream_reader(raw, read_across_frames=True) as reader:
        while True:
            try:
                chunk = reader.read(CHUNK)
            except zstandard.ZstdError as exc:
                raise BlobCorrupt(f"zstd cannot decompress it ({exc})") from exc
            if not chunk:
                break
            total += len(chunk)
            if expected_size is not None and total > expected_size:
                raise BlobCorrupt(f"decompresses beyond the {expected_size} bytes recorded for it")
            hasher.update(chunk)
            sink(chunk)
    if expected_size is not None and total != expected_size:
        raise BlobCorrupt(f"decompressed to {total} bytes, the index says {expected_size}")
    actual = hasher.hexdigest()
    if actual != digest:
        raise BlobCorrupt(f"content does not hash to its name (it hashes to {actual[:16]}…)")
    return total


def read_blob_bytes(blob_path: Path, digest: str, expected_size: int | None) -> bytes:
    """Return a blob's verified uncompressed bytes."""
    parts: list[bytes] = []
    stream_blob(blob_path, digest, expected_size, parts.append)
    return b"".join(parts)


def hash_blob(blob_path: Path, digest: str, expected_size: int | None) -> int:
    """Verify a blob without keeping its bytes; returns the uncompressed size."""
    return stream_blob(blob_path, digest, expected_size, lambda _chunk: None)


def extract_to(blob_path: Path, digest: str, expected_size: int | None, dest: Path) -> Path:
    """Stream a blob, verified, to ``dest``: written beside it first and renamed when good;
    ``BlobCorrupt`` (nothing left beside ``dest``) when its bytes do not hash to ``digest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    partial = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            stream_blob(blob_path, digest, expected_size, out.write)
        os.replace(partial, dest)
    except BaseException:  # a bad blob, the rename too: nothing of ours is left beside ``dest``
        partial.unlink(missing_ok=True)
        raise
    return dest
