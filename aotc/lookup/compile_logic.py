"""The key's ``aotc.compile_logic`` factor: a hash of aotc's own code that can change what a
compile stores, so an aotc upgrade that changes it is a clean miss, never a stale hit.

It is a walk of the ``aotc`` package, not a hand list: every module is hashed (name and source
bytes) unless :data:`NOT_COMPILE_LOGIC` names it with the reason its code cannot change a stored
artifact — so a new module is covered the day it is written. The files are read, never imported
(a lookup must not import the compile journey). The hash is computed once per process.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["NOT_COMPILE_LOGIC", "NOT_COMPILE_LOGIC_PACKAGES", "compile_logic_hash",
           "compile_logic_modules"]

_FLEET = "moves, verifies and signs stored entries byte for byte; never builds one"
_KEY = "computes the key itself: what changes an artifact enters it as a factor"
_WARM = "the warm start only: reads stored entries, the compile never runs it before storing"
_VLLM = "drives vLLM's engine; the graph it hands the backend is compiled by hashed code"

NOT_COMPILE_LOGIC: dict[str, str] = {
    "aotc": "the package's front door: lazy re-exports of the entry points",
    "aotc.counters": "counts events for tests and reports; no output depends on it",
    "aotc.errors": "exception classes and their messages",
    "aotc.progress": "progress lines (a stream, or the aotc.progress logger)",
    "aotc.log": "where aotc's log lines go (the aotc logger, AOTC_LOG), not what is compiled",
    "aotc.gc_pause": "when Python's garbage collector runs during a call, not what it computes",
    "aotc.settings": "reads AOTC_* variables; the ones a compile uses (sizes, ops) are factors",
    "aotc.fleet": _FLEET, "aotc.fleet.bundle": _FLEET, "aotc.fleet.remote": _FLEET,
    "aotc.fleet.remote_scan": _FLEET, "aotc.fleet.sync": _FLEET, "aotc.fleet.trust": _FLEET,
    "aotc.fleet.tiered": _FLEET, "aotc.fleet.oci": _FLEET, "aotc.fleet.objects": _FLEET,
    "aotc.fleet.lease": "decides which process of a fleet compiles a missing entry, not what it builds",
    "aotc.lookup": _KEY, "aotc.lookup.compile_logic": _KEY, "aotc.lookup.explain": _KEY,
    "aotc.lookup.filehash": _KEY, "aotc.lookup.resolve": _KEY, "aotc.lookup.stores": _KEY,
    "aotc.lookup.toolchain": _KEY,
    "aotc.records.entry_record": "the portable record of a stored entry (bundles, remotes)",
    "aotc.runtime.loader": _WARM, "aotc.runtime.cudagraph": _WARM, "aotc.runtime.report": _WARM,
    "aotc.vllm": _VLLM, "aotc.vllm.generate": _VLLM, "aotc.vllm.manifest": _VLLM,
    "aotc.vllm.plugin": "brings and ships vLLM's AOT records; compiles nothing",
    "aotc.vllm.aot_records": "stores and brings back vLLM's AOT record byte for byte",
    "aotc.models": "example models: traced, so their source is in the key's code factor",
    "aotc.models.toy_llama": "example models: traced, so their source is in the key's code factor",
}
# whole subpackages left out (installed under aotc/ from their own folders by a wheel, absent
# from an editable install's aotc/: the hash must not depend on how aotc was installed)
NOT_COMPILE_LOGIC_PACKAGES: dict[str, str] = {
    "aotc.cache": "the content-addressed store: blobs and the index, byte for byte",
    "aotc.cli": "the command line: parses, calls one library function, prints",
}


def _package_root() -> Path:
    return Path(__file__).resolve().parent.parent


def compile_logic_modules(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(dotted name, file)`` of every module of the package at ``root`` (default: this aotc)
    that the hash covers, sorted by name."""
    root = root or _package_root()
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        if "__pycache__" in rel.parts:
            continue
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(["aotc", *parts])
        if name not in NOT_COMPILE_LOGIC and not any(
                name == p or name.startswith(p + ".") for p in NOT_COMPILE_LOGIC_PACKAGES):
            found.append((name, path))
    return sorted(found)


def _hash(root: Path) -> str:
    h = hashlib.sha256()
    for name, path in compile_logic_modules(root):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _this_install() -> str:
    return _hash(_package_root())


def compile_logic_hash(root: Path | None = None) -> str:
    """sha256 over (module name, source) of every module :func:`compile_logic_modules` lists
    (``root``: another copy of the package; default this install, hashed once per process)."""
    return _this_install() if root is None else _hash(Path(root))
