"""What every remote store offers the transfer code (:mod:`aotc.fleet.sync`): an object
namespace — ``blobs/<digest>``, ``entries/<key>.json``, ``probes/<probe>/<key>``,
``signatures/<key>/<public key>`` — and its listings; plus a stream that checks the bytes it
hands out against their sha256 digest (a registry's layer)."""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from typing import Any

from aotc.errors import DamagedRemoteEntry, RemoteError

__all__ = ["DigestChecked", "ObjectNames", "RemoteObject", "file_digest", "split_name"]


@dataclass(frozen=True)
class RemoteObject:
    """One object as a listing describes it (``name`` is relative to the layout root)."""

    name: str
    size: int
    modified: float


class ObjectNames:
    """The names of the object namespace (the same on S3 and in a registry)."""

    @staticmethod
    def blob_name(digest: str) -> str:
        return f"blobs/{digest}"

    @staticmethod
    def entry_name(key: str) -> str:
        return f"entries/{key}.json"

    @staticmethod
    def probe_name(probe: str, key: str) -> str:
        return f"probes/{probe}/{key}"

    @staticmethod
    def signature_name(key: str, public_key: str) -> str:
        return f"signatures/{key}/{public_key}"


def split_name(name: str) -> tuple[str, str]:
    """(kind, rest) of an object name; a ``..`` part is refused (never a path out of it)."""
    kind, _, rest = name.partition("/")
    if ".." in rest.split("/"):
        raise RemoteError(f"{name!r}: not an aotc object name")
    return kind, rest


def file_digest(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(``sha256:<hex>``, size) of a file's bytes as they are (a registry's layer digest)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


class DigestChecked(io.RawIOBase):
    """A layer's byte stream that refuses bytes not hashing to the layer digest: checked once
    the layer's size is read (or the stream ends), before the reader sees the last bytes."""

    def __init__(self, raw: Any, digest: str, size: int, where: str) -> None:
        self._raw, self._digest, self._size, self._where = raw, digest, size, where
        self._hash, self._read = hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n if n is not None and n >= 0 else None, decode_content=True) or b""
        self._hash.update(data)
        self._read += len(data)
        if (not data or self._read >= self._size) and not self._matches():
            raise DamagedRemoteEntry(f"{self._where}: layer {self._digest[:19]}…: its bytes do not "
                                     "hash to its digest; refused")
        return data

    def _matches(self) -> bool:
        return self._read == self._size and "sha256:" + self._hash.hexdigest() == self._digest

    def close(self) -> None:
        self._raw.close()
        super().close()
