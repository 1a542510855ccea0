"""From a manifest and this machine to a store key, without tracing: the key factors, the lookup
of a stored entry whose recorded source files still hash the same, and ``explain`` for a miss.

The ``code`` factor (sha256 of every source file Dynamo traced) is only known after a trace, so an
entry also records a *probe* key: the hash of every factor but ``code``. A lookup finds the
entries with the same probe, re-hashes the files each recorded, and takes the one whose files are
unchanged (its full key recomputed from the current hashes must equal its stored key).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotc.cache import CacheMiss, CorruptedCacheError, Entry, Store
from aotc.counters import COUNTERS
from aotc.lookup.compile_logic import compile_logic_hash
from aotc.lookup.filehash import file_sha256
from aotc.lookup.toolchain import codegen_env, machine_factors
from aotc.manifest import Manifest, thaw
from aotc.records.key import FORMAT_VERSION, FactorDiff, compute_key, explain


def inductor_factors(patches: dict[str, Any], values: dict[str, Any], device: str) -> dict[str, Any]:
    """The Inductor part of the key: the manifest's (or backend's) patches as given; every
    setting this process would compile with — ``values`` (``aotc._torch.inductor_facts.
    config_values()``: Inductor's whole portable config minus its deny-list, canonical) with the
    patches of those settings applied; the TORCHINDUCTOR_* / TORCH_COMPILE_* / TORCHDYNAMO_*
    variables other than locations, thread counts and logging; and, for a CPU program whose C++
    kernels are written for a fixed team (``cpp.threads`` unset, ``cpp.dynamic_threads`` off:
    Inductor's defaults), the thread count they are written for (``torch.get_num_threads()``, as
    Inductor's own FX graph cache keys it): a process with another count is another key. A patch
    of a denied setting only enters ``patches``; a patch value with no canonical form makes the
    key a ``TypeError``."""
    applied = {**values, **{k: v for k, v in patches.items() if k in values}}
    factors: dict[str, Any] = {"patches": patches, "values": applied, "env": codegen_env()}
    if str(device).split(":", 1)[0] == "cpu" and not applied.get("cpp.dynamic_threads") \
            and int(applied.get("cpp.threads") or -1) < 1:
        import torch  # here: the store's commands import this module and never torch

        factors["cpu_threads"] = torch.get_num_threads()
    return factors


def base_factors(manifest: Manifest, machine: dict[str, Any]) -> dict[str, Any]:
    """Every key factor but ``code``: manifest, toolchain, Inductor settings, torch's process-wide
    settings (``global``), aotc's format and compile-logic hash. ``machine`` is
    ``aotc.lookup.toolchain.machine_factors(...)``."""
    m = manifest.key_factors()
    m.pop("inductor", None)
    return {"manifest": m, "toolchain": machine["toolchain"],
            "inductor": inductor_factors(thaw(manifest.inductor), machine["inductor_values"],
                                          manifest.device),
            "global": machine["global"],
            "aotc": {"format": FORMAT_VERSION, "compile_logic": compile_logic_hash()}}


# the key's process-wide settings (Inductor's and torch's): what building a model may change
# (the thread count too, but a server's differs from the compile's far more often: not looked up
# again after a build, whose cost would only delay the miss)
_SETTINGS = ("inductor.values.", "global.")


def reread_after_build(manifest: Manifest, before: dict[str, Any],
                       memo_dir: Path | None) -> tuple[dict[str, Any], list[str]]:
    """Once the manifest's model is built: this machine's factors read again
    (:func:`aotc.lookup.toolchain.machine_factors`, memo in ``memo_dir``) and the key's fields
    the build moved since ``before`` (dotted paths). Compared as key factors, not as settings
    read: a setting the manifest patches moves no key. The one place every door (compile, load,
    explain) asks whether a build changed the key (torchao's ``quantize_`` turns Inductor options
    on process-wide) before it looks up again."""
    after = machine_factors(manifest.device, memo_dir)
    return after, [d.path for d in explain(base_factors(manifest, before), base_factors(manifest, after))]


def is_setting(path: str) -> bool:
    """Whether a key field (a dotted path) is a process-wide setting, Inductor's or torch's."""
    return path.startswith(_SETTINGS)


def differs_in_settings(diffs: tuple[FactorDiff, ...] | list[FactorDiff]) -> bool:
    """Whether an entry differs from a lookup in process-wide settings — what a model's build
    may change (torchao's ``quantize_`` turns Inductor options on): looked up again once the
    model is built, an entry may be current."""
    return any(is_setting(d.path) for d in diffs)


def factory_source(manifest: Manifest) -> dict[str, str]:
    """The factory's own source file (relative path -> sha256): it may bake constants into the
    model that Dynamo never traces through, so it is always part of the ``code`` factor."""
    m = manifest.model
    if m.factory_file is not None:
        rel, path = Path(m.factory_file).name, Path(m.factory_file)  # as capture records it
    elif m.factory_module:
        spec = importlib.util.find_spec(m.factory_module)
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            return {}
        path = Path(spec.origin)
        rel = m.factory_module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
    else:
        return {}
    return {rel: hashlib.sha256(path.read_bytes()).hexdigest()}


def full_factors(base: dict[str, Any], code: dict[str, str]) -> dict[str, Any]:
    """``base`` plus the ``code`` group (relative source path -> sha256)."""
    return {**base, "code": dict(sorted(code.items()))}


def locate_source(rel: str, manifest: Manifest | None = None) -> Path | None:
    """Find the file a recorded relative source path names, on this machine (None if absent):
    beside the ``manifest``'s factory file, else on the import path."""
    factory_file = None if manifest is None else manifest.model.factory_file
    if factory_file is not None:
        if rel == Path(factory_file).name:
            return Path(factory_file)
        beside = Path(factory_file).parent / rel  # a sibling module the factory file imports
        if beside.is_file():
            return beside
    if rel.endswith(".py"):
        dotted = rel[:-3].replace("/", ".").removesuffix(".__init__")
        mod = sys.modules.get(dotted)
        f = getattr(mod, "__file__", None)
        if f:
            return Path(f)
        found = _in_top_package(rel)
        if found is not None:
            return found
    for entry in sys.path:
        cand = Path(entry or os.getcwd()) / rel
        if cand.is_file():
            return cand
    return None


def _in_top_package(rel: str) -> Path | None:
    """``pkg/sub/mod.py`` inside the installed top-level package ``pkg``, found without
    importing anything (a lookup must not import transformers to hash its files: 0.7 s)."""
    top = rel.split("/", 1)[0].removesuffix(".py")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: no parent package to import
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for loc in spec.submodule_search_locations or ():
        cand = Path(loc).parent / rel
        if cand.is_file():
            return cand
    if spec.origin and "/" not in rel and os.path.basename(spec.origin) == rel:
        return Path(spec.origin)
    return None


def hash_sources(recorded: dict[str, str], manifest: Manifest | None = None) -> dict[str, str]:
    """Current sha256 of each recorded source file ("missing" when it cannot be found)."""
    out = {}
    for rel in recorded:
        path = locate_source(rel, manifest)
        out[rel] = "missing" if path is None else file_sha256(path)
    return out


@dataclass(frozen=True)
class Probe:
    """What a lookup without tracing knows: ``base``, every key factor but ``code`` (its hash is
    the probe key every such entry records in its metadata); ``name``, the entries' name (for the
    closest miss); ``manifest``, where a recorded source path is looked for first (None: the
    import path only). An entry is current when its key, recomputed with ``base`` and its recorded
    files hashed as they are here, is its stored key. ``recorded``: the factor groups beyond
    ``base`` and ``code`` an entry of this kind records and a lookup takes as recorded (a
    precompiled function's example inputs); any other group in an entry makes it not current."""

    name: str
    base: dict[str, Any]
    manifest: Manifest | None = None
    recorded: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The probe key (the hash of ``base``)."""
        return compute_key(self.base)

    def current_factors(self, recorded: dict[str, Any]) -> dict[str, Any]:
        """The factors an entry that recorded ``recorded`` would have if built now."""
        code = recorded.get("code", {})
        kept = {k: recorded[k] for k in self.recorded if k in recorded}
        return {**kept, **self.base, "code": dict(sorted(hash_sources(dict(code), self.manifest).items()))}

    def unchanged(self, key: str, recorded: dict[str, Any]) -> bool:
        """Whether the entry ``key`` with factors ``recorded`` is what this probe builds now
        (the one test a local and a remote lookup share)."""
        return compute_key(self.current_factors(recorded)) == key


def manifest_probe(manifest: Manifest, machine: dict[str, Any]) -> Probe:
    """The probe of what ``manifest`` compiles to on ``machine``."""
    return Probe(manifest.name, base_factors(manifest, machine), manifest)


@dataclass(frozen=True)
class Resolution:
    """The outcome of a lookup: ``entry`` when hit, else the closest entry and why it missed."""

    probe: str
    entry: Entry | None
    closest: Entry | None = None
    diffs: tuple[FactorDiff, ...] = ()
    corrupt: CorruptedCacheError | None = None  # a same-probe entry found damaged on the way
    miss: tuple[str, str] | None = None  # what the store's stats record for this miss (key, why)

    @property
    def hit(self) -> bool:
        return self.entry is not None

    def record_miss(self, store: Store) -> None:
        """Count this miss in ``store``'s stats (a lookup made with ``record_miss=False``, whose
        caller knows only later that it stands: a build may move the key onto a hit)."""
        if self.entry is None and self.miss is not None:
            store.record_miss(*self.miss)


def sources_unchanged(key: str, code: dict[str, str], base: dict[str, Any], manifest: Manifest) -> bool:
    """Whether the entry ``key``, recorded with ``code``, is what this manifest compiles to now."""
    return Probe(manifest.name, base, manifest).unchanged(key, full_factors(base, code))


def _is_current(row: dict[str, Any], probe: Probe) -> bool:
    """:meth:`Probe.unchanged` for a (damaged) entry row. Unreadable factors: assume so (report
    the damage)."""
    try:
        return probe.unchanged(row["key"], json.loads(row["factors"]))
    except (TypeError, ValueError, AttributeError):
        return True


def resolve(manifest: Manifest, store: Store, machine: dict[str, Any], record: bool = True) -> Resolution:
    """Find the stored entry this manifest would compile to on this machine, without tracing.
    ``machine`` is ``aotc.lookup.toolchain.machine_factors(...)``."""
    return resolve_probe(manifest_probe(manifest, machine), store, record)


def resolve_probe(want: Probe, store: Store, record: bool = True,
                  record_miss: bool | None = None) -> Resolution:
    """The newest stored entry behind ``want``'s probe that is current (:class:`Probe`); else
    the closest entry and how it differs. ``record``: count the hit or miss in the store's stats;
    ``record_miss``, when given, decides for a miss alone — False for a second look after a first
    that counted it, or a first look whose caller counts the miss once it stands
    (:meth:`Resolution.record_miss`)."""
    if record_miss is None:
        record_miss = record
    probe = want.key
    rows = store.entry_rows(probe)  # bad entries too: get() raises for them, so a lookup says why
    candidates = []
    corrupt: CorruptedCacheError | None = None
    for row in rows:
        try:  # parsed here, not with json_extract: one garbage row must not break every lookup
            meta = json.loads(row["metadata"])
        except (TypeError, ValueError):
            continue
        if not isinstance(meta, dict) or meta.get("probe") != probe:
            continue
        try:
            candidates.append(store.get(row["key"], record=False))
        except CacheMiss:  # evicted meanwhile
            continue
        except CorruptedCacheError as exc:  # damaged (now marked bad): not a hit; kept to report
            if _is_current(row, want):  # not if it was built from older sources
                corrupt = corrupt or exc
            continue
    newest_miss: tuple[Entry, tuple[FactorDiff, ...]] | None = None
    for cand in candidates:  # every candidate: servers on older code may share a store
        current = want.current_factors(cand.factors)
        if compute_key(current) == cand.key:
            entry = store.get(cand.key, record=record)
            COUNTERS.cache_hits += 1
            return Resolution(probe, entry)
        if newest_miss is None:
            newest_miss = (cand, tuple(explain(cand.factors, current)))
    if newest_miss is not None:
        cand, cand_diffs = newest_miss
        res = Resolution(probe, None, cand, cand_diffs, corrupt,
                         miss=(cand.key, "; ".join(d.describe() for d in cand_diffs)[:500]))
        if record_miss:
            res.record_miss(store)
        return res
    # No entry with the same probe: diff against the newest entry of the same name, if any.
    same_name = store.newest_key_named(want.name)
    closest = None
    diffs: tuple[FactorDiff, ...] = ()
    if same_name:
        try:
            closest = store.get(same_name, record=False)
            diffs = tuple(explain(closest.factors, want.current_factors(closest.factors)))
        except (CacheMiss, CorruptedCacheError):
            closest = None
    res = Resolution(probe, None, closest, diffs, corrupt, miss=(probe, want.name))
    if record_miss:
        res.record_miss(store)
    return res
