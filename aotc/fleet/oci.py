"""An OCI registry as a remote store: ``oci://HOST[:PORT]/REPO`` wherever ``s3://`` is accepted.

Each entry is one OCI artifact in the repository (image manifest, ``artifactType``
:data:`ARTIFACT_TYPE`): its config blob is the entry record (``aotc.records.entry_record``,
the same bytes an S3 remote keeps as ``entries/<key>.json``), each aotc blob one layer — the
zstd bytes the store keeps, so the registry addresses it by the sha256 of those bytes and
dedups it across entries and models — annotated with the aotc digest (the sha256 of the
uncompressed bytes) it holds. Tags: the entry key, ``probe-<lookup key>`` (what a manifest
compiles to on a machine: the newest entry) and ``name-<manifest name>`` (the newest entry of
that name). Signatures travel as manifest annotations (``org.aotc.signature.<public key>``)
and are enforced on pull like any remote's (:mod:`aotc.fleet.trust`).

The registry client is the kept ``oras`` library (``pip install 'aotc[oci]'``), imported only
when an ``oci://`` remote is used; HTTP and credentials are :mod:`aotc.fleet.oci_http`'s.
:class:`OciRemote` offers the object namespace the transfer code (:mod:`aotc.fleet.sync`,
:mod:`aotc.fleet.remote_scan`) works with — ``blobs/<digest>``, ``entries/<key>.json``,
``probes/<probe>/<key>``, ``signatures/<key>/<public key>`` — mapped onto manifests, layers and
tags, so push, pull, pull-through, ``inspect``/``verify`` and the trust policy are the same code
for both kinds of remote. Everything read from the registry is checked before use: a manifest of
another type, shape or too large, a config or layer whose bytes do not hash to their digest, a
record naming a blob no layer holds — each is a ``RemoteError`` naming it, and nothing is
half-written locally (a pull stages and verifies every blob before the store's index row is
written).

Plain HTTP is used for a registry on a loopback address (a test or a node-local mirror) and
with ``insecure=True`` (``AOTC_OCI_INSECURE=1``, read at an entry point and handed over by
``aotc.fleet.remote.make_remote``); HTTPS otherwise. The remote never reads the environment.

No conditional writes: the OCI distribution API has none, and Debian's ``docker-registry``
2.8.2 (the CNCF distribution registry, tested) accepts a manifest PUT or DELETE whatever its
``If-Match`` / ``If-None-Match`` says. So ``conditional`` is False, :meth:`OciRemote.put_tagged`
and :meth:`OciRemote.delete_if_match` raise ``Unconditional``, and a registry remote has no
compile leases (:mod:`aotc.fleet.lease`: every process that misses compiles, as before).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

from aotc.cache import blobio
from aotc.errors import DamagedRemoteEntry, MissingObject, OversizedObject, RemoteError
from aotc.fleet.objects import DigestChecked, ObjectNames, RemoteObject, file_digest, split_name
from aotc.fleet.oci_http import RegistryHttp
from aotc.fleet.remote_api import MAX_RECORD, Tagged, Unconditional

__all__ = ["ARTIFACT_TYPE", "OciRemote", "is_oci_url"]

ARTIFACT_TYPE = "application/vnd.aotc.entry.v1"
CONFIG_TYPE = "application/vnd.aotc.entry.record.v1+json"
LAYER_TYPE = "application/vnd.aotc.blob.v1+zstd"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
DIGEST_NOTE = "org.aotc.digest"
SIGNATURE_NOTE = "org.aotc.signature."
KEY_NOTE = "org.aotc.key"
MAX_MANIFEST = 4 << 20
TAG_PAGE = 1000  # tags asked for per page of a listing
_REPO = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
_OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^[A-Za-z0-9.-]+(?::[0-9]{1,5})?$")


def is_oci_url(value: object) -> bool:
    """Whether ``value`` names an OCI registry remote (``oci://…``)."""
    return isinstance(value, str) and value.startswith("oci://")


def _plain_notes(notes: object) -> bool:
    """Whether ``notes`` is what an annotations field must be: text names to text values."""
    return isinstance(notes, dict) and all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in notes.items())


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class OciRemote(ObjectNames):
    """The registry repository at ``url`` (``oci://host[:port]/repo``), as an object store (a
    :class:`aotc.fleet.remote_api.Remote`). ``insecure``: plain HTTP (None: only for a loopback
    host); ``docker_config``: the docker config directory whose ``config.json`` holds the
    credentials (None: ``~/.docker``, as oras reads it)."""

    conditional = False  # module doc: a registry has no conditional writes

    def __init__(self, url: str, insecure: bool | None = None,
                 docker_config: str | os.PathLike[str] | None = None) -> None:
        if not is_oci_url(url):
            raise RemoteError(f"{url!r} is not an OCI remote URL: expected oci://host[:port]/repo")
        host, _, repo = url[len("oci://"):].strip("/").partition("/")
        if not _HOST.match(host) or not repo or not _REPO.match(repo):
            raise RemoteError(f"{url!r}: expected oci://host[:port]/repo (repo: lowercase "
                              "letters, digits, . _ - and /)")
        self.url, self.host, self.repo = f"oci://{host}/{repo}", host, repo
        if insecure is None:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
            insecure = name in ("localhost", "127.0.0.1", "::1")
        self.insecure = insecure
        self.http = RegistryHttp(self.url, host, repo, insecure,
                                 Path(docker_config) if docker_config is not None else None)
        self._request, self._read = self.http.request, self.http.read
        self._layers: dict[str, tuple[str, int]] = {}  # aotc digest -> (layer digest, size)
        self.root = ""

    def __repr__(self) -> str:
        return f"OciRemote({self.url!r})"

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        return self.http.errors

    def _manifest(self, ref: str) -> tuple[dict[str, Any], str] | None:
        """The aotc manifest tagged ``ref`` and its digest; None when the tag does not exist."""
        r = self._request(f"GET manifest {ref}", "GET", f"manifests/{ref}",
                          headers={"Accept": MANIFEST_TYPE}, stream=True)
        if r.status_code != 200:
            r.close()
            if r.status_code == 404:
                return None
            raise RemoteError(f"{self.url}: GET manifest {ref} failed: HTTP {r.status_code}")
        raw = self._read(r, MAX_MANIFEST, f"GET manifest {ref}")
        if len(raw) > MAX_MANIFEST:
            raise OversizedObject(f"{self.url}: manifest {ref} is larger than {MAX_MANIFEST} bytes")
        try:
            m = json.loads(raw)
            ok = (isinstance(m, dict) and m.get("artifactType") == ARTIFACT_TYPE
                  and isinstance(m.get("config"), dict) and m["config"].get("mediaType") == CONFIG_TYPE
                  and isinstance(m.get("layers"), list)
                  and all(isinstance(x, dict) for x in m["layers"])
                  and _plain_notes(m.get("annotations", {}))
                  and all(_plain_notes(x.get("annotations", {})) for x in m["layers"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise DamagedRemoteEntry(f"{self.url}: tag {ref} is not an aotc entry (artifactType "
                                     f"{ARTIFACT_TYPE} expected)")
        return m, _sha(raw)

    def _put_manifest(self, manifest: dict[str, Any], ref: str) -> None:
        body = json.dumps(manifest, sort_keys=True).encode()
        r = self._request(f"PUT manifest {ref}", "PUT", f"manifests/{ref}", data=body,
                          headers={"Content-Type": MANIFEST_TYPE})
        if r.status_code not in (200, 201):
            raise RemoteError(f"{self.url}: PUT manifest {ref} failed: HTTP {r.status_code} {r.text[:200]}")

    def _blob_bytes(self, digest: str, limit: int) -> bytes:
        r = self._request(f"GET blob {digest[:19]}", "GET", f"blobs/{digest}", stream=True)
        if r.status_code != 200:
            r.close()
            raise MissingObject(f"{self.url}: blob {digest[:19]}… is missing (HTTP {r.status_code})")
        data = self._read(r, limit, f"GET blob {digest[:19]}")
        if len(data) > limit:
            raise OversizedObject(f"{self.url}: blob {digest[:19]}… is larger than {limit} bytes")
        if _sha(data) != digest:
            raise DamagedRemoteEntry(f"{self.url}: blob {digest[:19]}…: its bytes do not hash to "
                                     "its digest; refused")
        return data

    def _upload_bytes(self, data: bytes, media_type: str) -> dict[str, Any]:
        digest = _sha(data)
        if self._request("HEAD blob", "HEAD", f"blobs/{digest}").status_code != 200:
            start = self._request("POST blob", "POST", "blobs/uploads/")
            where = start.headers.get("Location", "")
            if start.status_code != 202 or not where:
                raise RemoteError(f"{self.url}: blob upload refused: HTTP {start.status_code}")
            where = self.http.absolute(where)
            sep = "&" if "?" in where else "?"
            done = self._request("blob upload", "PUT", f"{where}{sep}digest={digest}", timeout=600,
                                 data=data, headers={"Content-Type": "application/octet-stream"})
            if done.status_code != 201:
                raise RemoteError(f"{self.url}: blob upload failed: HTTP {done.status_code}")
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def _entry_manifest(self, key: str) -> dict[str, Any]:
        found = self._manifest(key)
        if found is None:
            raise MissingObject(f"{self.url}: no entry {key[:16]}…")
        return found[0]

    # -- the object namespace ---------------------------------------------------------------
    def head(self, name: str) -> int | None:
        """The size of object ``name``, or None when there is none (a blob is known only after
        its entry's manifest was read or it was uploaded here)."""
        kind, rest = split_name(name)
        if kind == "blobs":
            layer = self._layers.get(rest)
            if layer is None:
                return None
            r = self._request("HEAD blob", "HEAD", f"blobs/{layer[0]}")
            return layer[1] if r.status_code == 200 else None
        if kind == "probes":
            probe, _, key = rest.partition("/")
            found = self._manifest(f"probe-{probe}")
            return 0 if found is not None and found[0].get("annotations", {}).get(KEY_NOTE) == key else None
        raw = self.get_bytes(name)
        return None if raw is None else len(raw)

    def get_bytes(self, name: str, limit: int = MAX_RECORD) -> bytes | None:
        """The bytes of a record or signature object, or None when there is none."""
        kind, rest = split_name(name)
        if kind == "entries" and rest.endswith(".json"):
            found = self._manifest(rest[: -len(".json")])
            if found is None:
                return None
            m = found[0]
            if not _OCI_DIGEST.match(str(m["config"].get("digest"))):
                raise DamagedRemoteEntry(f"{self.url}: entry {rest[:16]}…: bad config digest; refused")
            record = self._blob_bytes(str(m["config"]["digest"]), min(limit, MAX_RECORD))
            for layer in m["layers"]:
                digest = str((layer.get("annotations") or {}).get(DIGEST_NOTE))
                if (layer.get("mediaType") != LAYER_TYPE or not blobio.is_digest(digest)
                        or not _OCI_DIGEST.match(str(layer.get("digest")))
                        or not isinstance(layer.get("size"), int)):
                    raise DamagedRemoteEntry(f"{self.url}: entry {rest[:16]}… has a layer that is "
                                             "not an aotc blob; refused")
                self._layers[digest] = (str(layer["digest"]), int(layer["size"]))
            return record
        if kind == "signatures":
            key, _, public = rest.partition("/")
            found = self._manifest(key)
            if found is None:
                return None
            sig = found[0].get("annotations", {}).get(SIGNATURE_NOTE + public)
            return None if sig is None else str(sig).encode()[:limit]
        return None

    def get_tagged(self, name: str, limit: int = MAX_RECORD) -> Tagged | None:
        """:meth:`get_bytes` with a tag naming those bytes (their sha256): a registry has no
        version to write against (:meth:`put_tagged`)."""
        data = self.get_bytes(name, limit)
        return None if data is None else Tagged(data, _sha(data))

    def put_tagged(self, name: str, body: bytes, if_match: str | None = None,
                   if_absent: bool = False) -> str | None:
        """Not offered: a registry ignores ``If-Match`` / ``If-None-Match`` (module doc)."""
        raise Unconditional(f"{self.url}: a registry has no conditional writes ({name})")

    def delete_if_match(self, name: str, etag: str) -> bool:
        """Not offered: a registry ignores ``If-Match`` on DELETE (module doc)."""
        raise Unconditional(f"{self.url}: a registry has no conditional deletes ({name})")

    def open(self, name: str) -> tuple[BinaryIO, int]:
        """A stream of blob ``name`` (its layer's bytes, checked against the layer digest as it
        is read) and its size."""
        kind, digest = split_name(name)
        layer = self._layers.get(digest) if kind == "blobs" else None
        if layer is None:
            raise MissingObject(f"{self.url}: {name} is named by no layer of the entry's manifest")
        r = self._request(f"GET blob {digest[:16]}", "GET", f"blobs/{layer[0]}", stream=True)
        if r.status_code != 200:
            r.close()
            raise MissingObject(f"{self.url}: the layer of blob {digest[:16]}… is missing "
                                f"(HTTP {r.status_code})")
        return cast(BinaryIO, DigestChecked(r.raw, layer[0], layer[1], self.url)), layer[1]

    def put(self, name: str, body: bytes | BinaryIO, if_absent: bool = False,
            strict: bool = False) -> bool | None:
        """Create object ``name`` (a record, a probe marker or a signature). A registry has no
        conditional create: with ``strict`` that is None (no compile leases here)."""
        if strict:
            return None
        data = body if isinstance(body, bytes) else body.read()
        kind, rest = split_name(name)
        if kind == "entries":
            key = rest[: -len(".json")]
            if if_absent and self._manifest(key) is not None:
                return False
            self._put_entry(key, data)
            return True
        if kind == "probes":
            probe, _, key = rest.partition("/")
            m = self._entry_manifest(key)
            self._put_manifest(m, f"probe-{probe}")
            return True
        if kind == "signatures":
            key, _, public = rest.partition("/")
            m = self._entry_manifest(key)
            m.setdefault("annotations", {})[SIGNATURE_NOTE + public] = data.decode()
            self._retag(key, m)
            return True
        raise RemoteError(f"{self.url}: cannot store {name!r} in a registry")

    def _put_entry(self, key: str, record: bytes) -> None:
        rec = json.loads(record)
        layers: builtins.list[dict[str, Any]] = []
        seen: set[str] = set()
        for b in rec["blobs"].values():
            d = b["digest"]
            if d in seen:
                continue
            seen.add(d)
            if d not in self._layers:
                raise RemoteError(f"{self.url}: blob {d[:16]}… of {key[:16]}… was not uploaded")
            oci_digest, size = self._layers[d]
            layers.append({"mediaType": LAYER_TYPE, "digest": oci_digest, "size": size,
                           "annotations": {DIGEST_NOTE: d}})
        config = self._upload_bytes(record, CONFIG_TYPE)
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", str(rec.get("name", "entry")))[:100] or "entry"
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                    "config": config, "layers": layers,
                    "annotations": {KEY_NOTE: key, "org.opencontainers.image.title": name}}
        self._put_manifest(manifest, key)
        self._put_manifest(manifest, f"name-{name}")

    def _retag(self, key: str, manifest: dict[str, Any]) -> None:
        """Re-point the key's tags (and its probe's, when that names this key) at ``manifest``."""
        probe = self._probe_of(key)
        self._put_manifest(manifest, key)
        if probe is not None:
            found = self._manifest(f"probe-{probe}")
            if found is not None and found[0].get("annotations", {}).get(KEY_NOTE) == key:
                self._put_manifest(manifest, f"probe-{probe}")

    def _probe_of(self, key: str) -> str | None:
        raw = self.get_bytes(self.entry_name(key))
        if raw is None:
            return None
        probe = json.loads(raw).get("metadata", {}).get("probe")
        return probe if blobio.is_digest(probe) else None

    def learn_local(self, files: Mapping[str, str | os.PathLike[str]]) -> None:
        """Learn the layer digest of local blob files (aotc digest -> path) about to be pushed,
        so :meth:`head` can ask the registry whether it already holds those bytes."""
        for digest, path in files.items():
            if digest not in self._layers:
                self._layers[digest] = file_digest(path)

    def upload(self, name: str, path: Any, on_bytes: Any = None) -> None:
        """Upload a stored blob file as a layer (skipped when the registry holds those bytes)."""
        kind, digest = split_name(name)
        with open(path, "rb") as f:
            data = f.read()
        layer = self._upload_bytes(data, LAYER_TYPE)
        self._layers[digest] = (layer["digest"], layer["size"])
        if on_bytes is not None:
            on_bytes(len(data))

    def delete(self, name: str) -> None:
        """Remove an entry's tag (its manifest) or a blob; no error when it is already gone."""
        kind, rest = split_name(name)
        if kind == "entries":
            found = self._manifest(rest[: -len(".json")])
            if found is not None:
                self._deleted("DELETE manifest", f"manifests/{found[1]}")
        elif kind == "blobs" and rest in self._layers:
            self._deleted("DELETE blob", f"blobs/{self._layers.pop(rest)[0]}")
        elif kind == "signatures":
            key, _, public = rest.partition("/")
            found = self._manifest(key)
            if found is not None and SIGNATURE_NOTE + public in found[0].get("annotations", {}):
                del found[0]["annotations"][SIGNATURE_NOTE + public]
                self._retag(key, found[0])

    def _deleted(self, what: str, path: str) -> None:
        status = self._request(what, "DELETE", path).status_code
        if status not in (200, 202, 404):  # Distribution answers 405 when deletes are off
            raise RemoteError(f"{self.url}: {what} refused: HTTP {status}"
                              + (" (this registry has deletion disabled)" if status == 405 else ""))

    def list(self, prefix: str) -> Iterator[RemoteObject]:
        """The objects under ``prefix``: entries (the key tags), the blobs of the entries read
        so far, a probe's entry, a key's signatures."""
        kind, rest = split_name(prefix)
        if kind == "blobs":  # the layers of the entries read so far (a registry lists no blobs)
            for digest, (_layer, size) in sorted(self._layers.items()):
                yield RemoteObject(f"blobs/{digest}", size, 0.0)
        elif kind == "entries":
            for tag in self.http.tags(TAG_PAGE, MAX_RECORD):
                if blobio.is_digest(tag):
                    yield RemoteObject(f"entries/{tag}.json", 0, 0.0)
        elif kind == "probes":
            found = self._manifest(f"probe-{rest.rstrip('/')}")
            key = found[0].get("annotations", {}).get(KEY_NOTE) if found else None
            if blobio.is_digest(key):
                yield RemoteObject(f"probes/{rest.rstrip('/')}/{key}", 0, 0.0)
        elif kind == "signatures":
            key = rest.rstrip("/")
            found = self._manifest(key) if blobio.is_digest(key) else None
            for note, sig in (found[0].get("annotations", {}) if found else {}).items():
                if note.startswith(SIGNATURE_NOTE):
                    yield RemoteObject(f"signatures/{key}/{note[len(SIGNATURE_NOTE):]}", len(sig), 0.0)

