"""The ``toolchain`` key factors, remembered on disk per machine so a lookup need not import
Inductor (1.2 s of the 1.7 s they cost to compute here).

The memo is a JSON file under ``<store>/store-v1/toolchain/`` named by a fingerprint of every
input the factors are derived from: interpreter, torch's install (version, path, mtimes of the
files ``torch_key`` hashes change with), triton's install, the C++ compiler binary, the CPU's
model and flags, the code-changing TORCHINDUCTOR_* variables (not the host name: replicas of
one image share a memo, and everything the facts depend on is in the fingerprint). Any change
gives a new fingerprint and the factors are computed afresh; a CUDA device's GPU fields are always read live.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

_GPU_FIELDS = ("gpu", "compute_capability", "cuda")
# Variables of torch's compile stack that cannot change generated code: locations, threads, logs.
_ENV_IGNORE = ("DIR", "PATH", "LOGPATH", "THREADS", "VERBOSE", "DEBUG", "TRACE", "LOG")


def codegen_env() -> dict[str, str]:
    """TORCHINDUCTOR_* / TORCH_COMPILE_* / TORCHDYNAMO_* variables that may change generated
    code (all but locations such as TORCHINDUCTOR_CACHE_DIR, thread counts and logging)."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_"))
            and not any(k.endswith(sfx) or f"_{sfx}_" in k for sfx in _ENV_IGNORE)}


def _fingerprint_env() -> dict[str, str]:
    """Every variable torch's compile stack may read (thread counts included: Inductor's config
    reads TORCHINDUCTOR_CPP_DYNAMIC_THREADS), locations aside: what the memo's values depend on."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("TORCHINDUCTOR_", "TORCH_", "TORCHDYNAMO_", "PYTORCH_"))
            and not k.endswith(("DIR", "PATH", "_HOME"))}


def _stat(path: str | None) -> list[Any]:
    if not path:
        return [None]
    try:
        st = os.stat(path)
        return [os.path.realpath(path), st.st_size, st.st_mtime_ns]
    except OSError:
        return [path, None]


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return hashlib.sha256("\n".join(sorted(set(keep))).encode()).hexdigest()


def fingerprint(device: str) -> str:
    """sha256 of everything the toolchain factors depend on, on this machine."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    triton = importlib.util.find_spec("triton")
    cxx = os.environ.get("CXX", "g++")
    parts = {
        "python": [sys.executable, sys.version],
        "torch": [torch.__version__, *_stat(os.path.join(torch_dir, "__init__.py")),
                  *_stat(os.path.join(torch_dir, "version.py")),
                  *_stat(os.path.join(torch_dir, "_inductor", "codecache.py"))],
        "triton": _stat(triton.origin if triton else None),
        "cxx": [cxx, *_stat(shutil.which(cxx))],
        "cpu": _cpu_identity(),
        "env": _fingerprint_env(),  # not the cache dir: one memo serves every Inductor cache dir
        "device": device.split(":")[0],
        # how the memo's values are computed: a new aotc (another set of keyed settings) recomputes
        "facts": [_stat(os.path.join(os.path.dirname(os.path.dirname(__file__)), "_torch", name))
                  for name in ("inductor_facts.py", "global_factors.py")],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def machine_factors(device: str, memo_dir: Path | None = None) -> dict[str, Any]:
    """``{"toolchain": …, "inductor_values": …, "global": …}`` for this machine and process: the
    toolchain factors (``aotc._torch.inductor_facts.toolchain_factors``), the unpatched
    code-changing Inductor settings (``inductor_facts.config_values``) and the process-wide torch
    settings Inductor's own cache keys (``aotc._torch.global_factors``: read live at every call).

    The toolchain factors and the list of torch's hash-detail fields come from the memo when its
    fingerprint matches, else are computed (importing Inductor) and remembered. Inductor's
    settings come from the memo only while this process has not imported Inductor's config (so
    nothing in it can have changed one in-process); once it has, they are read live (3 ms) and
    never written to the memo — this process may have changed a setting, or a ``TORCHINDUCTOR_*``
    variable after Inductor read them: one process's state is never another's key. A build fills
    the memo's values from a fresh interpreter instead (:func:`remember_fresh_values`)."""
    from aotc._torch import global_factors, inductor_facts

    imported = "torch._inductor.config" in sys.modules
    path = None if memo_dir is None else memo_dir / f"{fingerprint(device)}.json"
    memo: Any = None
    if path is not None:
        try:
            memo = json.loads(path.read_text())
        except (OSError, ValueError):
            memo = None
    dirty = False
    if not (isinstance(memo, dict) and {"toolchain", "global_fields"} <= set(memo)):
        memo = {"toolchain": inductor_facts.toolchain_factors(device),
                "global_fields": global_factors.hash_detail_fields()}
        dirty = True
    elif device.startswith("cuda"):  # the GPU is not in the fingerprint: read it live
        live = inductor_facts.toolchain_factors(device)
        memo["toolchain"].update({k: v for k, v in live.items() if k in _GPU_FIELDS})
    if imported or "inductor_values" not in memo:
        values = inductor_facts.config_values()  # live: 3 ms once Inductor's config is imported
        if not imported:  # imported just now, from this environment: what a fresh process reads
            memo["inductor_values"] = values
            dirty = True
    else:
        values = memo["inductor_values"]
    if dirty and path is not None:
        _write_memo(path, memo)
    return {"toolchain": memo["toolchain"], "inductor_values": values,
            "global": global_factors.global_factors(memo["global_fields"])}


def remember_fresh_values(device: str, memo_dir: Path | None) -> None:
    """Give the memo (written by :func:`machine_factors`) Inductor's settings as a fresh process
    with this environment reads them, computed by a fresh interpreter when this process has
    imported Inductor's config (its own values may hold in-process changes) — so the first warm
    start after a build finds them without importing Inductor. Once per memo (~2 s, within the
    build's call); never raises: without them a warm start computes its own."""
    if memo_dir is None:
        return
    path = memo_dir / f"{fingerprint(device)}.json"
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(memo, dict) or "inductor_values" in memo:
        return
    import subprocess

    code = ("import json, sys; from aotc._torch.inductor_facts import config_values; "
            "sys.stdout.write(json.dumps(config_values()))")
    try:  # this interpreter and environment: aotc is found as this process found it
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, check=True, stdin=subprocess.DEVNULL)
        memo["inductor_values"] = json.loads(res.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return
    _write_memo(path, memo)


def _write_memo(path: Path, memo: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        saved = {**memo, "toolchain": {k: v for k, v in memo["toolchain"].items() if k not in _GPU_FIELDS}}
        tmp.write_text(json.dumps(saved, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only store: no memo, same factors


def check_built_here(entry: Any, memo_dir: Path | None) -> None:
    """Raise ``LoadError`` unless ``entry`` was built with this machine's toolchain (compiler,
    CPU ISA or GPU, torch, Python), under this process's torch settings (``global``: matmul
    precision, deterministic algorithms …) and with this aotc's compile logic — the check for an entry
    loaded by key alone (``aotc.load(key=…)``, a saved backend record), whose key this process
    did not compute from its own toolchain. ``memo_dir``: the store's toolchain memo."""
    from aotc.errors import LoadError
    from aotc.lookup.compile_logic import compile_logic_hash

    device = str(entry.metadata.get("device") or "cpu")
    machine = machine_factors(device, memo_dir)
    mine: dict[str, Any] = machine["toolchain"]
    theirs = entry.factors.get("toolchain") or {}
    if theirs != mine:
        differ = sorted(k for k in set(mine) | set(theirs) if theirs.get(k) != mine.get(k))
        raise LoadError(f"stored entry {entry.key[:16]}… ({entry.name}) was built for another machine "
                        f"(toolchain differs in {', '.join(differ[:4])}); compile it here")
    if "global" in entry.factors and entry.factors["global"] != machine["global"]:
        from aotc.records.key import explain

        differ = [d.path for d in explain(entry.factors["global"], machine["global"])]
        raise LoadError(f"stored entry {entry.key[:16]}… ({entry.name}) was built under other torch "
                        f"settings ({', '.join(differ[:3])} differ); compile it in this process's settings")
    if (entry.factors.get("aotc") or {}).get("compile_logic") != compile_logic_hash():
        raise LoadError(f"stored entry {entry.key[:16]}… ({entry.name}) was built by another aotc "
                        "version; compile it again")
