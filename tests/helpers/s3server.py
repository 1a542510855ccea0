"""A real S3-compatible server for the tests: moto's standalone server (Flask/Werkzeug, speaking
the S3 REST protocol over HTTP) in a child process on 127.0.0.1, a free port, in-memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

# Credentials and region the server accepts, and no reach for the machine's own AWS config or
# the EC2 metadata service.
S3_ENV = {"AWS_ACCESS_KEY_ID": "aotc-test", "AWS_SECRET_ACCESS_KEY": "aotc-test-secret",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
          "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def stop(proc: subprocess.Popen) -> None:
    """Stop a test server: terminate, then kill after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def s3_server(log_path: str) -> Iterator[str]:
    """Start the server; yield its endpoint URL; stop it."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 test server did not start; see {log_path}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
