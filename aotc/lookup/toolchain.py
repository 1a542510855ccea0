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
        "env": codegen_env(),  # not the cache dir: one memo serves every Inductor cache dir
        "device": device.split(":")[0],
        # how the memo's values are computed: a new aotc (another set of keyed settings) recomputes
        "facts": _stat(os.path.join(os.path.dirname(os.path.dirname(__file__)), "_torch",
                                    "inductor_facts.py")),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def machine_factors(device: str, memo_dir: Path | None = None) -> dict[str, Any]:
    """``{"toolchain": …, "inductor_values": …}`` for this machine: the toolchain factors
    (``aotc._torch.inductor_facts.toolchain_factors``) and the unpatched code-changing Inductor settings
    (``aotc._torch.inductor_facts.config_values``), from the memo when its fingerprint matches, else computed
    (importing Inductor) and remembered."""
    from aotc._torch import inductor_facts

    def compute() -> dict[str, Any]:
        return {"toolchain": inductor_facts.toolchain_factors(device),
                "inductor_values": inductor_facts.config_values()}

    if memo_dir is None:
        return compute()
    path = memo_dir / f"{fingerprint(device)}.json"
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        memo = None
    if not (isinstance(memo, dict) and {"toolchain", "inductor_values"} <= set(memo)):
        memo = compute()
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            saved = {"toolchain": {k: v for k, v in memo["toolchain"].items() if k not in _GPU_FIELDS},
                     "inductor_values": memo["inductor_values"]}
            tmp.write_text(json.dumps(saved, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only store: no memo, same factors
        return memo
    if device.startswith("cuda"):  # the GPU is not in the fingerprint: read it live
        live = inductor_facts.toolchain_factors(device)
        memo["toolchain"].update({k: v for k, v in live.items() if k in _GPU_FIELDS})
    return memo


def check_built_here(entry: Any, memo_dir: Path | None) -> None:
    """Raise ``LoadError`` unless ``entry`` was built with this machine's toolchain (compiler,
    CPU ISA or GPU, torch, Python) and this aotc's compile logic — the check for an entry
    loaded by key alone (``aotc.load(key=…)``, a saved backend record), whose key this process
    did not compute from its own toolchain. ``memo_dir``: the store's toolchain memo."""
    from aotc.errors import LoadError
    from aotc.lookup.compile_logic import compile_logic_hash

    device = str(entry.metadata.get("device") or "cpu")
    mine: dict[str, Any] = machine_factors(device, memo_dir)["toolchain"]
    theirs = entry.factors.get("toolchain") or {}
    if theirs != mine:
        differ = sorted(k for k in set(mine) | set(theirs) if theirs.get(k) != mine.get(k))
        raise LoadError(f"stored entry {entry.key[:16]}… ({entry.name}) was built for another machine "
                        f"(toolchain differs in {', '.join(differ[:4])}); compile it here")
    if (entry.factors.get("aotc") or {}).get("compile_logic") != compile_logic_hash():
        raise LoadError(f"stored entry {entry.key[:16]}… ({entry.name}) was built by another aotc "
                        "version; compile it again")
