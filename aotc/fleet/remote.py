"""A remote store on S3 or any S3-compatible server (MinIO, Ceph, moto): ``s3://bucket/prefix``.

Layout under ``<prefix>/store-v1/``::

    blobs/<sha256>                 zstd bytes exactly as a local store keeps them
    entries/<key>.json             the entry record (``aotc.records.entry_record``), written after its blobs
    probes/<probe>/<key>           empty marker, written after the record: a lookup by manifest
                                   lists one prefix instead of every record
    signatures/<key>/<public key>  a signature (hex), one object per signer

Objects are only ever created whole (an S3 PUT is atomic), blobs are named by content, and a
record is written only after every blob it names was seen on the server: a reader never finds
an entry whose blobs are missing. Endpoint, region and credentials come from boto3's own
configuration (environment, ``~/.aws``), with ``endpoint_url`` for an S3-compatible server
(``AOTC_S3_ENDPOINT``, read at an entry point into :class:`aotc.settings.Settings` and handed to
:func:`make_remote`: the remote itself never reads the environment). boto3 is imported only when
a remote is used.

Conditional writes (what a compile lease needs, :mod:`aotc.fleet.lease`): a create with
``If-None-Match: *``, a replace with ``If-Match: <ETag>`` and a delete with ``If-Match`` — AWS S3
since 2024 (creates in August, replaces and deletes in November), MinIO, and moto's server
(tested: moto 5.2.5 with boto3/botocore 1.44.8). A server that ignores the headers is found by
the lease's probe, never trusted blindly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from aotc.errors import MissingObject, OversizedObject, RemoteError
from aotc.fleet.objects import ObjectNames, RemoteObject
from aotc.fleet.remote_api import MAX_RECORD, Remote, Tagged, Unconditional
from aotc.settings import ENV, Settings, is_remote_url  # noqa: F401 - is_remote_url: re-exported

ENDPOINT_ENV = ENV["s3_endpoint"]  # for messages: the variable is read in aotc.settings
LAYOUT = "store-v1"
_CONFLICT_RETRIES = 5  # a 409 ConditionalRequestConflict: another conditional write in flight


def _boto3() -> Any:
    try:
        import boto3
        import botocore
    except ImportError:  # pragma: no cover - an optional dependency; the message names the fix
        raise RemoteError("an s3:// store needs boto3: pip install 'aotc[s3]' (or boto3)") from None
    return boto3, botocore


class S3Remote(ObjectNames):
    """The remote store at ``url`` (``s3://bucket[/prefix]``) on ``endpoint_url`` (None: boto3's
    own configuration decides). A :class:`aotc.fleet.remote_api.Remote`."""

    conditional = True  # If-None-Match / If-Match on PUT and DELETE (module doc)

    def __init__(self, url: str, endpoint_url: str | None = None) -> None:
        if not (isinstance(url, str) and url.startswith("s3://")):
            raise RemoteError(f"{url!r} is not an S3 remote URL: expected s3://bucket[/prefix]")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket or any(c in bucket for c in " \\?#"):
            raise RemoteError(f"{url!r}: no valid bucket name; expected s3://bucket[/prefix]")
        prefix = prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{prefix}" if prefix else "")
        self.bucket = bucket
        self.root = (f"{prefix}/" if prefix else "") + f"{LAYOUT}/"
        self.endpoint_url = endpoint_url
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 S3 client, made on first use (boto3 is imported only then)."""
        if self._client is None:
            boto3, botocore = _boto3()
            config = botocore.config.Config(retries={"max_attempts": 4, "mode": "standard"},
                                            connect_timeout=10, read_timeout=120)
            try:
                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.endpoint_url, config=config)
            except (botocore.exceptions.BotoCoreError, ValueError) as e:
                raise RemoteError(f"{self.url}: cannot set up the S3 client ({e}); check "
                                  f"--endpoint-url / {ENDPOINT_ENV} and the AWS configuration") from None
        return self._client

    @property
    def _boto3(self) -> Any:
        return _boto3()[0]

    @property
    def _botocore(self) -> Any:
        return _boto3()[1]

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """The exceptions boto3 raises for a failed request or a broken transfer."""
        ex = self._botocore.exceptions
        return (ex.BotoCoreError, ex.ClientError)

    def __repr__(self) -> str:
        return f"S3Remote({self.url!r})"

    # -- operations -------------------------------------------------------------------------
    def _fail(self, exc: Exception, what: str) -> RemoteError:
        """One-line error for a boto/botocore failure, naming the fix."""
        ex = self._botocore.exceptions
        if isinstance(exc, ex.NoCredentialsError):
            why = ("no credentials: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile "
                   "(boto3's usual configuration)")
        elif isinstance(exc, (ex.EndpointConnectionError, ex.ConnectTimeoutError)):
            why = (f"cannot reach {self.endpoint_url or 'the S3 endpoint'}; check --endpoint-url "
                   f"/ {ENDPOINT_ENV}")
        elif isinstance(exc, ex.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", "?"))
            why = {"NoSuchBucket": f"bucket {self.bucket!r} does not exist",
                   "AccessDenied": "access denied (check the credentials' permissions)",
                   "403": "access denied (check the credentials' permissions)",
                   "InvalidAccessKeyId": "the access key is not known to the server",
                   "SignatureDoesNotMatch": "the secret key does not match"}.get(code, f"{code}: {exc}")
        else:
            why = str(exc)
        return RemoteError(f"{self.url}: {what} failed: {why}")

    def _conditional_fail(self, exc: Exception, what: str) -> RemoteError:
        """``Unconditional`` for a server that answers a conditional request "not implemented"."""
        if self._code(exc) in ("NotImplemented", "501"):
            return Unconditional(f"{self.url}: {what}: the server has no conditional writes")
        return self._fail(exc, what)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (self._botocore.exceptions.BotoCoreError, self._botocore.exceptions.ClientError) as e:
            raise self._fail(e, what) from None

    @staticmethod
    def _code(exc: Exception) -> str:
        return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))

    def _maybe(self, what: str, fn: Any, name: str) -> Any:
        """``fn(Bucket, Key)`` for object ``name``; None when the object does not exist."""
        try:
            return fn(Bucket=self.bucket, Key=self.root + name)
        except self._botocore.exceptions.ClientError as e:
            if self._code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._fail(e, f"{what} {name}") from None
        except self._botocore.exceptions.BotoCoreError as e:
            raise self._fail(e, f"{what} {name}") from None

    def head(self, name: str) -> int | None:
        """The size of object ``name``, or None when there is none."""
        resp = self._maybe("HEAD", self.client.head_object, name)
        return None if resp is None else int(resp["ContentLength"])

    def get_bytes(self, name: str, limit: int = MAX_RECORD) -> bytes | None:
        """The bytes of a small object (at most ``limit``), or None when there is none."""
        resp = self._maybe("GET", self.client.get_object, name)
        return None if resp is None else self._read_body(resp["Body"], name, limit)

    def _read_body(self, body: Any, name: str, limit: int) -> bytes:
        try:
            data = body.read(limit + 1)
        except (self._botocore.exceptions.BotoCoreError, OSError) as e:
            raise self._fail(e, f"GET {name}") from None
        finally:
            body.close()
        if len(data) > limit:
            raise OversizedObject(f"{self.url}: {name} is larger than {limit} bytes: not written "
                                  "by aotc")
        return data

    def get_tagged(self, name: str, limit: int = MAX_RECORD) -> Tagged | None:
        """The bytes of a small object and its ETag (one GET), or None when there is none."""
        resp = self._maybe("GET", self.client.get_object, name)
        if resp is None:
            return None
        return Tagged(self._read_body(resp["Body"], name, limit), str(resp["ETag"]))

    def open(self, name: str) -> tuple[BinaryIO, int]:
        """A stream of object ``name`` and its size (``MissingObject`` when there is none)."""
        resp = self._maybe("GET", self.client.get_object, name)
        if resp is None:
            raise MissingObject(f"{self.url}: {name} is missing")
        return resp["Body"], int(resp.get("ContentLength", 0))

    def put(self, name: str, body: bytes | BinaryIO, if_absent: bool = False,
            strict: bool = False) -> bool | None:
        """Create or replace object ``name``. With ``if_absent`` only create it (a conditional
        PUT): False when it already exists. A server without conditional writes falls back to
        HEAD then PUT — or, with ``strict``, returns None (nothing written)."""
        kwargs: dict[str, Any] = {"Key": self.root + name, "Body": body}
        if if_absent:
            for attempt in range(5):
                if hasattr(body, "seek"):
                    body.seek(0)
                try:
                    self.client.put_object(Bucket=self.bucket, IfNoneMatch="*", **kwargs)
                    return True
                except self._botocore.exceptions.ClientError as e:
                    code = self._code(e)
                    if code in ("PreconditionFailed", "412"):
                        return False
                    if code in ("ConditionalRequestConflict", "409") and attempt < 4:
                        time.sleep(0.2 * (attempt + 1))  # a concurrent write in flight: retry
                        continue
                    if code not in ("NotImplemented", "501"):
                        raise self._fail(e, f"PUT {name}") from None
                    if strict:
                        return None
                except self._botocore.exceptions.BotoCoreError as e:
                    raise self._fail(e, f"PUT {name}") from None
                break
            # a server without conditional writes: HEAD then PUT (last writer wins in a race)
            if self.head(name) is not None:
                return False
            if hasattr(body, "seek"):
                body.seek(0)
        self._call(f"PUT {name}", self.client.put_object, **kwargs)
        return True

    def upload(self, name: str, path: str | os.PathLike[str], on_bytes: Any = None) -> None:
        """Upload a file to object ``name`` (multipart when large); ``on_bytes(n)`` is called as
        bytes go out."""
        try:
            self.client.upload_file(os.fspath(path), self.bucket, self.root + name, Callback=on_bytes)
        except (self._botocore.exceptions.BotoCoreError, self._botocore.exceptions.ClientError) as e:
            raise self._fail(e, f"upload of {name}") from None
        except self._boto3.exceptions.S3UploadFailedError as e:
            raise RemoteError(f"{self.url}: upload of {name} failed: {e}") from None
        except OSError as e:
            raise RemoteError(f"{self.url}: upload of {name} failed reading the local file ({e}); "
                              "a concurrent `aotc gc`? push again") from None

    def delete(self, name: str) -> None:
        """Remove object ``name`` (no error when it is already gone)."""
        self._call(f"DELETE {name}", self.client.delete_object, Key=self.root + name)

    def put_tagged(self, name: str, body: bytes, if_match: str | None = None,
                   if_absent: bool = False) -> str | None:
        """Write ``name`` only if it is still ETag ``if_match`` (or, with ``if_absent``, does not
        exist): its new ETag, or None when the condition failed (412, or 404: it is gone). A
        409 (another conditional write in flight) is retried."""
        cond = {"IfMatch": if_match} if if_match is not None else {"IfNoneMatch": "*"} if if_absent else {}
        attempt = 0
        while True:
            try:
                resp = self.client.put_object(Bucket=self.bucket, Key=self.root + name, Body=body, **cond)
                return str(resp["ETag"])
            except self._botocore.exceptions.ClientError as e:
                code = self._code(e)
                if code in ("PreconditionFailed", "412") or (if_match and code in ("NoSuchKey", "404")):
                    return None
                attempt += 1
                if code in ("ConditionalRequestConflict", "409") and attempt < _CONFLICT_RETRIES:
                    time.sleep(0.2 * attempt)
                    continue
                raise self._conditional_fail(e, f"conditional PUT {name}") from None
            except self._botocore.exceptions.BotoCoreError as e:
                raise self._fail(e, f"conditional PUT {name}") from None

    def delete_if_match(self, name: str, etag: str) -> bool:
        """Remove ``name`` only if it is still ETag ``etag``: whether it was removed."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.root + name, IfMatch=etag)
            return True
        except self._botocore.exceptions.ClientError as e:
            if self._code(e) in ("PreconditionFailed", "412", "NoSuchKey", "404"):
                return False
            raise self._conditional_fail(e, f"conditional DELETE {name}") from None
        except self._botocore.exceptions.BotoCoreError as e:
            raise self._fail(e, f"conditional DELETE {name}") from None

    def learn_local(self, files: Mapping[str, str | os.PathLike[str]]) -> None:
        """Nothing to learn: S3 names a blob by its aotc digest."""

    def list(self, prefix: str) -> Iterator[RemoteObject]:
        """Every object whose name starts with ``prefix``, in name order."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.root + prefix):
                for obj in page.get("Contents", []):
                    yield RemoteObject(obj["Key"][len(self.root):], int(obj["Size"]),
                                       obj["LastModified"].timestamp())
        except (self._botocore.exceptions.BotoCoreError, self._botocore.exceptions.ClientError) as e:
            raise self._fail(e, f"LIST {prefix}") from None


def make_remote(url: str, settings: Settings, endpoint_url: str | None = None) -> Remote:
    """The remote a URL names: ``s3://bucket[/prefix]`` (an :class:`S3Remote` on ``endpoint_url``,
    else ``settings.s3_endpoint``) or ``oci://host[:port]/repo`` (an
    :class:`aotc.fleet.oci.OciRemote`, plain HTTP with ``settings.oci_insecure``, credentials from
    ``settings.docker_config``). ``settings``: read once at the caller's entry point."""
    if isinstance(url, str) and url.startswith("oci://"):
        from aotc.fleet.oci import OciRemote

        return OciRemote(url, insecure=True if settings.oci_insecure else None,
                         docker_config=settings.docker_config)
    if not is_remote_url(url):
        raise RemoteError(f"{url!r} is not a remote store URL: expected s3://bucket[/prefix] or "
                          "oci://host[:port]/repo")
    return S3Remote(url, endpoint_url or settings.s3_endpoint)


def open_remote(url: str | None, settings: Settings, endpoint_url: str | None = None) -> Remote | None:
    """The remote ``url`` names, else the settings' (``AOTC_REMOTE``), else None."""
    url = url or settings.remote
    return make_remote(url, settings, endpoint_url) if url else None
