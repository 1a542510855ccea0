"""``aotc explain``: why a manifest hits or misses the store on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aotc.cache import Store
from aotc.manifest import Manifest, load_manifest
from aotc.toolchain import machine_factors
from aotc.resolve import resolve


def explain_manifest(manifest: Manifest | str | Path, store: Store) -> dict[str, Any]:
    """A JSON-able report: ``hit``, ``key``, ``closest`` entry and field-by-field ``differences``."""
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    res = resolve(m, store, machine_factors(m.device, store.base / "toolchain"), record=False)
    if res.entry is not None:
        return {"hit": True, "key": res.entry.key, "closest": res.entry.key, "differences": [],
                "summary": f"{m.name}: hit, key {res.entry.key[:16]}… is in {store.root}"}
    if res.closest is None:
        return {"hit": False, "key": None, "closest": None, "differences": [],
                "summary": f"{m.name}: miss; the store {store.root} has no entry of that name "
                           f"to compare with; run `aotc compile {m.path or 'MANIFEST'}`"}
    diffs = [d.describe() for d in res.diffs]
    return {"hit": False, "key": None, "closest": res.closest.key, "differences": diffs,
            "summary": f"{m.name}: miss; closest entry {res.closest.key[:16]}… differs in "
                       f"{len(diffs)} factor(s) (stored -> current):"}
