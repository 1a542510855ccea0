"""A real OCI registry for the tests: Debian's ``docker-registry`` (the CNCF distribution
registry, 2.8) in a child process on 127.0.0.1, a free port, filesystem storage in a temporary
directory, deletes enabled. ``.ci/run`` installs the package; elsewhere the tests skip."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.helpers.s3server import free_port, stop

BINARY = "docker-registry"


def available() -> bool:
    return shutil.which(BINARY) is not None


@contextmanager
def oci_registry(root: Path, htpasswd: Path | None = None,
                 delete: bool = True) -> Iterator[tuple[str, Path]]:
    """Start a registry storing under ``root``; yield (``host:port``, its blob data directory).
    ``htpasswd``: a file of bcrypt ``user:hash`` lines — the registry then wants Basic auth;
    ``delete``: whether it allows deletes (Distribution's default is not to)."""
    port = free_port()
    data = root / "data"
    config = root / "config.yml"
    auth = f"auth:\n  htpasswd:\n    realm: aotc-test\n    path: {htpasswd}\n" if htpasswd else ""
    config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {data}\n  delete:\n    enabled: {str(delete).lower()}\n"
                      f"{auth}http:\n  addr: 127.0.0.1:{port}\n")
    with open(root / "registry.log", "wb") as log:
        proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError as e:
                if isinstance(e, urllib.error.HTTPError) and e.code == 401:  # up, wants credentials
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the OCI test registry did not start; see {root}/registry.log")
                time.sleep(0.1)
        yield f"127.0.0.1:{port}", data / "docker" / "registry" / "v2" / "blobs" / "sha256"
    finally:
        stop(proc)
