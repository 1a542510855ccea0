"""No aotc process outlives its caller (DESIGN: "a guest in the server": it starts no fork, thread
or compile that outlives the call that needed it).

A fresh process compiles cold — through ``torch.compile(backend="aotc")`` of a tiny model with
attention (a graph the backend splits), with ``AOTC_MERGE=1`` set (the removed merged programs'
switch: it must start nothing), and through ``aotc compile -j 2`` (forked workers) — and exits.
Every process it started inherits a marker variable; once it has exited, ``/proc/*/environ`` must
show none of them alive (a worker that is exiting gets ~2 s to be reaped).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import AOTC_CLI, PYTHON, python_env, tiny_manifest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_MARKER = "AOTC_TEST_LEFTOVER_MARKER"

_BACKEND_CHILD = """
import torch
import torch.nn.functional as F


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(1, -1, 16))


torch.manual_seed(0)
model = Attn().eval()
x = torch.randn(1, 5, 16)
with torch.no_grad():
    got = torch.compile(model, backend="aotc")(x)
    assert torch.allclose(got, model(x), atol=1e-4), "compiled output differs"
print("called", flush=True)
"""


def _env(tmp: Path, marker: str) -> dict[str, str]:
    """A fresh process's environment: its own empty store, Inductor cache and TMPDIR, the
    retired merge switch on, and the marker every process it starts inherits."""
    for d in ("store", "inductor", "tmp"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    return {**python_env(), "AOTC_STORE": str(tmp / "store"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
            "TMPDIR": str(tmp / "tmp"), "AOTC_MERGE": "1", "AOTC_FALLBACK": "error", _MARKER: marker}


def _carrying(marker: str) -> list[str]:
    """``pid: command line`` of every live process whose environment holds ``marker``."""
    needle = f"{_MARKER}={marker}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = next((ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:")), "")
            if "Z" in state.split()[1:2]:  # a zombie: exited, not yet reaped by its (new) parent
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(f"{proc.name}: {cmd[:200]}")
    return found


def _none_left(marker: str, grace: float = 2.0) -> list[str]:
    """The processes still carrying ``marker`` after up to ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while (left := _carrying(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.slow
def test_no_aotc_process_outlives_its_caller(tmp_path: Path) -> None:
    # torch.compile(backend="aotc"), cold, of a graph split at attention, AOTC_MERGE=1 set
    marker = uuid.uuid4().hex
    res = subprocess.run([PYTHON, "-c", _BACKEND_CHILD], capture_output=True, text=True,
                         env=_env(tmp_path / "backend", marker), timeout=600)
    assert res.returncode == 0 and "called" in res.stdout, res.stderr[-3000:]
    assert list((tmp_path / "backend" / "store").rglob("index.sqlite")), "the backend stored nothing"
    assert _none_left(marker) == [], "processes of the backend's caller still alive after it exited"
    # the kernels' header and the ISA probes it started while Dynamo traced: killed, cleaned up
    assert not [p.name for p in (tmp_path / "backend" / "tmp").iterdir() if p.is_file()], "compiler files left"

    # aotc compile -j 2 (a forked worker) of the tiny manifest, cold
    marker = uuid.uuid4().hex
    manifest = tiny_manifest(tmp_path)
    res = subprocess.run([*AOTC_CLI, "compile", "-j", "2", str(manifest)], capture_output=True, text=True,
                         env=_env(tmp_path / "cli", marker), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _none_left(marker) == [], "processes of `aotc compile -j 2` still alive after it exited"


def test_the_removed_merge_switches_start_nothing_and_break_nothing(caplog) -> None:
    """``merge=`` (argument or ``torch.compile`` option) is one warning and ignored; ``AOTC_MERGE``
    is not read; ``aotc.wait_for_merges`` returns True at once."""
    import logging

    import aotc
    from aotc.backend.config import BackendConfig, call_config
    from aotc.settings import Settings

    with caplog.at_level(logging.WARNING, logger="aotc"):
        be = aotc.backend(merge=True)
    said = [r.getMessage() for r in caplog.records if "merge" in r.getMessage()]
    assert said == ["aotc: warning: merged programs were removed in this version; merge= is ignored"]
    assert not hasattr(be.config, "merge") and not hasattr(Settings.from_env({"AOTC_MERGE": "1"}), "merge")
    assert call_config(BackendConfig(), {"options": {"merge": False}}) == BackendConfig()
    assert aotc.wait_for_merges(0) is True and aotc.wait_for_merges() is True
