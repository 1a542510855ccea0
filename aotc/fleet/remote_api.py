"""What a remote store offers: the :class:`Remote` protocol, implemented by
:class:`aotc.fleet.remote.S3Remote` (``s3://``) and :class:`aotc.fleet.oci.OciRemote` (``oci://``).

The transfer code (:mod:`aotc.fleet.sync`, :mod:`aotc.fleet.remote_scan`) and the compile lease
(:mod:`aotc.fleet.lease`) are typed against it and never ask which kind of remote they hold. A
remote is built at an entry point (``aotc.fleet.remote.make_remote`` / ``open_remote`` from a
:class:`aotc.settings.Settings`) and takes everything it needs as constructor arguments: no
remote reads the environment.

Objects live in one namespace (:class:`aotc.fleet.objects.ObjectNames`): ``blobs/<digest>``,
``entries/<key>.json``, ``probes/<probe>/<key>``, ``signatures/<key>/<public key>``,
``leases/<id>.json``. Conditional operations (``put_tagged``, ``delete_if_match``) are what a
lease needs to never have two holders; ``conditional`` says whether a kind of remote offers
them at all (S3: yes — a server may still ignore the headers, which :mod:`aotc.fleet.lease`
probes once; a registry: no, and :class:`Unconditional` is raised).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

from aotc.errors import RemoteError
from aotc.fleet.objects import RemoteObject

__all__ = ["MAX_RECORD", "Remote", "Tagged", "Unconditional"]

MAX_RECORD = 16 << 20  # the most bytes a record, signature or lease object is read up to


class Unconditional(RemoteError):
    """The remote cannot make a write conditional (no compare-and-swap there)."""


@dataclass(frozen=True)
class Tagged:
    """An object's bytes and the version tag the server gave them (S3: the ETag, quoted as the
    server sends it): the ``if_match`` of a later conditional write."""

    data: bytes
    etag: str


@runtime_checkable
class Remote(Protocol):
    """A remote store: an object namespace with atomic whole-object writes (module doc)."""

    url: str

    @property
    def conditional(self) -> bool:
        """Whether :meth:`put_tagged` and :meth:`delete_if_match` are offered (else they raise
        :class:`Unconditional`); whether the server honours them is probed by the lease."""
        ...

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """What reading a stream from :meth:`open` may raise besides ``RemoteError``."""
        ...

    def blob_name(self, digest: str) -> str: ...
    def entry_name(self, key: str) -> str: ...
    def probe_name(self, probe: str, key: str) -> str: ...
    def signature_name(self, key: str, public_key: str) -> str: ...

    def head(self, name: str) -> int | None:
        """The size of object ``name``, or None when there is none."""
        ...

    def get_bytes(self, name: str, limit: int = MAX_RECORD) -> bytes | None:
        """The bytes of a small object (``OversizedObject`` past ``limit``), None when absent."""
        ...

    def get_tagged(self, name: str, limit: int = MAX_RECORD) -> Tagged | None:
        """:meth:`get_bytes` with the object's version tag, in one request; None when absent."""
        ...

    def open(self, name: str) -> tuple[BinaryIO, int]:
        """A stream of object ``name`` and its size (``MissingObject`` when there is none)."""
        ...

    def put(self, name: str, body: bytes | BinaryIO, if_absent: bool = False,
            strict: bool = False) -> bool | None:
        """Create or replace ``name``; with ``if_absent`` only create it (False: it exists). A
        server without conditional creates: HEAD then PUT, or with ``strict`` None."""
        ...

    def put_tagged(self, name: str, body: bytes, if_match: str | None = None,
                   if_absent: bool = False) -> str | None:
        """Write ``name`` only if it is still version ``if_match`` (or, with ``if_absent``, does
        not exist): its new version tag, or None when the condition failed (another wrote or
        removed it). :class:`Unconditional` where the remote has no such writes."""
        ...

    def upload(self, name: str, path: str | os.PathLike[str],
               on_bytes: Callable[[int], object] | None = None) -> None:
        """Upload a local file to ``name``; ``on_bytes(n)`` as bytes go out."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name`` (no error when it is already gone)."""
        ...

    def delete_if_match(self, name: str, etag: str) -> bool:
        """Remove ``name`` only if it is still version ``etag``: whether it was removed (False:
        another version, or gone). :class:`Unconditional` where the remote cannot."""
        ...

    def list(self, prefix: str) -> Iterator[RemoteObject]:
        """Every object whose name starts with ``prefix``."""
        ...

    def learn_local(self, files: Mapping[str, str | os.PathLike[str]]) -> None:
        """Be told the local blob files (aotc digest -> path) about to be pushed, before their
        HEADs (a registry addresses a blob by the hash of its stored bytes; a no-op on S3)."""
        ...
