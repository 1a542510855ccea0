"""``aotc explain``: why a manifest hits or misses the store on this machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from aotc.cache import Store
from aotc.lookup.resolve import differs_in_settings, reread_after_build, resolve
from aotc.lookup.toolchain import machine_factors
from aotc.manifest import Manifest, load_manifest


def explain_manifest(manifest: Manifest | str | Path, store: Store) -> dict[str, Any]:
    """A JSON-able report: ``hit``, ``key``, ``closest`` entry and field-by-field ``differences``."""
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    machine = machine_factors(m.device, store.base / "toolchain")
    res = resolve(m, store, machine, record=False)
    built = ""
    if res.entry is None and differs_in_settings(res.diffs):
        # the entry may be keyed by settings the model's build sets (torchao's quantize_), as
        # a compile and a load key it: built here, and looked up again
        from aotc.model.build import build_model

        try:
            build_model(m)
        except Exception as e:  # noqa: BLE001 - a model that cannot be built here: the report as it stands
            built = f" (the model could not be built to read the settings its build sets: {type(e).__name__})"
        else:
            after, moved = reread_after_build(m, machine, store.base / "toolchain")
            if moved:
                res = resolve(m, store, after, record=False)
                built = " (keyed with the settings building the model set)"
    if res.entry is not None:
        return {"hit": True, "key": res.entry.key, "closest": res.entry.key, "differences": [],
                "summary": f"{m.name}: hit, key {res.entry.key[:16]}… is in {store.root}{built}"}
    if res.closest is None:
        return {"hit": False, "key": None, "probe": res.probe, "closest": None, "differences": [],
                "summary": f"{m.name}: miss; the store {store.root} has no entry of that name "
                           f"to compare with; run `aotc compile {m.path or 'MANIFEST'}`"}
    diffs = [d.describe() for d in res.diffs]
    return {"hit": False, "key": None, "probe": res.probe, "closest": res.closest.key, "differences": diffs,
            "summary": f"{m.name}: miss; lookup key {res.probe[:16]}… (every factor but the "
                       f"traced sources); the closest stored entry, key {res.closest.key[:16]}…, "
                       f"differs in {len(diffs)} factor(s) (stored -> current){built}:"}


def match_key(text: str, keys_with_prefix: Callable[[str], list[str]], where: str,
              listing: str) -> str:
    """The one key that ``text`` (a key or a prefix of >= 8 hex chars) names among
    ``keys_with_prefix(prefix)``; ``InputError`` naming ``where`` and the ``listing`` command
    otherwise. Shared by the local store and a remote one."""
    from aotc.errors import InputError

    text = text.strip().lower()
    if len(text) < 8 or any(c not in "0123456789abcdef" for c in text):
        raise InputError(f"{text!r} is not a key: give a stored key or a prefix of >= 8 hex chars "
                         f"({listing} lists them)")
    found = keys_with_prefix(text)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise InputError(f"{what} stored entries match {text!r} in {where}; {listing} lists the keys")
    return found[0]


def resolve_key(store: Store, text: str) -> str:
    """A full stored key from a key or a unique prefix of one (>= 8 hex chars)."""
    return match_key(text, lambda p: [k for k in store.keys() if k.startswith(p)],
                     str(store.root), "`aotc inspect cache`")


def entry_key_for(store: Store, target: str) -> str:
    """The stored key TARGET names: a manifest file (its entry for this machine; a miss is a
    ``CacheMiss`` naming the fix) or a key / unique key prefix."""
    from aotc.cache import CacheMiss

    if Path(target).is_file():
        report = explain_manifest(target, store)
        if not report["hit"]:
            closest = f"; the closest stored entry is {report['closest'][:16]}…" if report["closest"] else ""
            raise CacheMiss(report["probe"], label="lookup key",
                            hint=f"{target} is not compiled in {store.root} for this machine"
                                 f"{closest}; run `aotc compile {target}`")
        return str(report["key"])
    return resolve_key(store, target)


def explain_keys(store: Store, key_a: str, key_b: str) -> dict[str, Any]:
    """Every key factor that differs between two stored entries (A's value -> B's value)."""
    from aotc.records.key import explain

    a = store.get(resolve_key(store, key_a), record=False)
    b = store.get(resolve_key(store, key_b), record=False)
    diffs = explain(a.factors, b.factors)
    return {"hit": None, "key": b.key, "closest": a.key,
            "differences": [d.describe() for d in diffs],
            "diff": [{"path": d.path, "a": d.stored, "b": d.current} for d in diffs],
            "summary": f"{a.name} {a.key[:16]}… vs {b.name} {b.key[:16]}…: "
                       + (f"{len(diffs)} factor(s) differ (A -> B):" if diffs else "same factors")}
