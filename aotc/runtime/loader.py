"""The warm start: manifest (or key) → stored entry (every blob verified) → Program → artifacts
rehydrated with their shipped kernels → bound to the live model's weights → ``Runner``.

No Dynamo trace and no Inductor compile happen here: the key is resolved without tracing
(``aotc.lookup.resolve``). A piece whose generated wrapper qualified at compile time runs through
``aotc._torch.wrapper`` (Inductor is never imported); any other piece is loaded with
``CompiledArtifact.load``; both over the kernel libraries compiled at ``aotc compile`` time.
``AOTC_LOADER=inductor`` forces ``CompiledArtifact.load`` for every piece.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotc.cache import CacheMiss, Entry, Store, unpacked
from aotc.context import Context
from aotc.errors import LoadError
from aotc.fleet.tiered import TieredStore
from aotc.log import configure
from aotc.lookup.resolve import Resolution, differs_in_settings, is_setting, reread_after_build
from aotc.lookup.stores import as_manifest
from aotc.lookup.toolchain import machine_factors
from aotc.manifest import Manifest
from aotc.model.build import build_model
from aotc.records.program import PROGRAM_ROLE, Program
from aotc.runtime.rehydrate import rehydrate
from aotc.runtime.runner import Runner
from aotc.runtime.stitched import Timings

if TYPE_CHECKING:
    from aotc.runtime.cudagraph import GraphedRunner

_WORKDIRS: list[Path] = []


def _remove_workdirs() -> None:
    for p in _WORKDIRS:
        shutil.rmtree(p, ignore_errors=True)


def _workdir() -> Path:
    """A per-process directory for rehydrated artifacts (a read-only store's); removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="aotc-load-"))
    if not _WORKDIRS:
        atexit.register(_remove_workdirs)
    _WORKDIRS.append(path)
    return path


def _resolve(manifest: Manifest, tiered: TieredStore, timings: Timings, machine: dict[str, Any],
             record_miss: bool = True) -> Resolution:
    t = time.perf_counter()
    res = tiered.find(manifest, machine, record_miss)  # the local tier, else pulled through from the remote
    timings.add("resolve", time.perf_counter() - t - tiered.pull_seconds)
    if tiered.pulled_bytes:
        timings.add("pull", tiered.pull_seconds)
        timings.pulled_bytes = tiered.pulled_bytes
    return res


def _entry_or_miss(res: Resolution, manifest: Manifest, tiered: TieredStore) -> Entry:
    if res.entry is not None:
        return res.entry
    if res.corrupt is not None:  # the entry for this machine exists but is damaged: say that
        raise res.corrupt
    remote = tiered.remote
    where = manifest.path or manifest.name
    why = ""
    if res.closest is not None:
        why = f"; the closest stored entry, key {res.closest.key[:16]}… ({res.closest.name}), differs"
        why += (" in " + ", ".join(d.path for d in res.diffs[:4])) if res.diffs else ""
    changed = [d.path.removeprefix("code.") for d in res.diffs if d.path.startswith("code.")]
    if changed:
        why += f" (changed source file: {', '.join(changed[:3])})"
    where_remote = f" nor in {remote.url}" if remote is not None else ""
    if res.closest is not None and res.diffs and all(is_setting(d.path) for d in res.diffs):
        raise CacheMiss(res.probe, label="lookup key (every factor but the traced sources)",
                        hint=f"{manifest.name} is compiled (key {res.closest.key[:16]}…) under other "
                             f"process-wide settings than this process has: "
                             f"{', '.join(d.describe() for d in res.diffs[:4])}; set them as the compile "
                             f"had them (building the model as the manifest does sets them, e.g. "
                             f"torchao's quantize_: `aotc.load` without `model=` builds it so)")
    raise CacheMiss(res.probe, label="lookup key (every factor but the traced sources)",
                    hint=f"{manifest.name} is not compiled for this machine{where_remote}{why}; run "
                         f"`aotc compile {where}` (and `aotc explain {where}` to see why)")


def _extract(entry: Entry, store: Store, files: dict[str, str], held: ExitStack) -> tuple[Path, bool]:
    """The entry's blobs (role → relative path), verified, under one directory, and whether it is
    the store's shared unpacked copy (``aotc.cache.unpacked``: extracted once, re-hashed on each
    use, held until ``held`` closes) — else, for a read-only store, a per-process directory."""
    got = unpacked.unpack(store, entry, files)
    if got is not None:
        held.enter_context(got)
        return got.path, True
    work = _workdir()
    store.extract_blobs(entry, {role: work / rel for role, rel in files.items()})
    return work, False


def _writable_kernels(store: Store, kernels: Path, rels: list[str]) -> Path:
    """A kernel root of this process's own for Inductor, which writes its regenerated sources into
    its cache dir and reads them back: those must never land in the shared unpacked copy."""
    try:
        return unpacked.private_dir(store, kernels, rels)
    except OSError:
        work = _workdir() / "kernels"
        for rel in rels:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kernels / rel, work / rel)
        return work


def rehydrate_entry(entry: Entry, store: Store, timings: Timings, options: dict[str, Any] | None,
                    fast: bool = True) -> tuple[Program, dict[str, dict[int | None, Any]]]:
    """An entry's program and its artifacts as callables (by unique piece and size): every file
    verified (the store's unpacked copy, or a per-process directory for a read-only store), each
    artifact rehydrated (the fast path where recorded, unless ``fast`` is False: the context's
    ``loader``). The entry is one the tiered store handed out: trust-checked there."""
    t = time.perf_counter()
    program = Program.from_json(store.read_blob(entry, PROGRAM_ROLE))
    files = {role: f"kernels/{rel}" for rel, role in program.kernel_roles.items()}
    for a in program.artifacts:
        role = a.wrapper_role if fast and a.wrapper_role else a.role
        files[role] = f"artifacts/{role.replace('/', '_')}"
    with ExitStack() as held:
        work, shared = _extract(entry, store, files, held)
        kernel_root = work / "kernels"
        if shared and any(not (fast and a.wrapper_role) for a in program.artifacts):
            kernel_root = _writable_kernels(store, kernel_root, list(program.kernel_roles))
        dests = {role: work / rel for role, rel in files.items()}
        timings.add("read+verify", time.perf_counter() - t)
        t = time.perf_counter()
        by_uid = rehydrate(program, dests, kernel_root, options, fast=fast)
        timings.add("deserialize", time.perf_counter() - t)
    return program, by_uid


def load_entry(entry: Entry, store: Store, model: Any, timings: Timings | None = None,
               options: dict[str, Any] | None = None, cudagraph: str = "piecewise",
               capture_sizes: Any = None, fast: bool = True) -> Runner | GraphedRunner:
    """Rehydrate one entry into a Runner bound to ``model``; on CUDA, capture graphs
    (``cudagraph`` mode) for ``capture_sizes`` (default: the program's). ``entry``: as the
    tiered store handed it out (trust-checked there, before any blob is read). ``fast``: the
    no-Inductor fast path where recorded (the context's ``loader``)."""
    timings = timings or Timings()
    program, by_uid = rehydrate_entry(entry, store, timings, options, fast)
    runner = Runner(program, by_uid, model, key=entry.key, timings=timings)
    sizes = program.capture_sizes if capture_sizes is None else capture_sizes
    if program.device.startswith("cuda") and cudagraph != "none" and sizes:
        from aotc.runtime.cudagraph import capture

        return capture(runner, cudagraph, sizes, device=program.device) or runner
    return runner


def load(manifest: Manifest | str | Path | None = None, model: Any = None, store: Any = None,
         device: str | None = None, trust: Any = (), remote: Any = None, *, key: str | None = None,
         context: Context | None = None) -> Runner | GraphedRunner:
    """Warm-start a compiled model (see module doc). Two explicit paths:

    - ``manifest`` (a ``Manifest`` or a path to one): the key is resolved for this machine;
      ``model`` (the module whose parameters to bind: the server's own weights) is built from
      the manifest when None; ``device`` overrides the manifest's device.
    - ``key=`` a stored key (64 hex chars) with ``model=`` required: the entry must have been
      built for this machine's toolchain and this aotc (else ``LoadError``).

    ``trust``: public keys (hex) to require a signature by, besides ``AOTC_TRUST_KEYS``
    (:mod:`aotc.fleet.trust`). ``remote``: a remote store (``s3://…``, ``oci://…`` or a remote
    object; default ``AOTC_REMOTE``) to pull the entry from on a local miss; ``store="s3://…"``
    means that remote in front of the default local store. ``context``: an entry point's
    :class:`~aotc.context.Context` (default: the environment with these arguments). Raises
    ``CacheMiss`` naming the fix, ``TrustError`` for an entry the policy refuses."""
    if context is not None and (store is not None or remote is not None or trust):
        raise LoadError("aotc.load: give store=/remote=/trust= or context=, not both (a context "
                        "carries its own)")
    context = context or Context.from_env(store=store, remote=remote, trust=trust)  # read once
    configure(context.settings.log)
    if key is not None and manifest is None:
        found = _by_key(key, model, context)
    elif manifest is not None and key is None:
        found = _by_manifest(as_manifest(manifest), model, device, context)
    else:
        raise LoadError("aotc.load: give a manifest (a path or a Manifest) or key= (a stored "
                        "key, with model=), not both and not neither")
    return load_entry(found.entry, found.store, found.model, found.timings, options=found.options,
                      cudagraph=found.cudagraph, capture_sizes=found.capture_sizes,
                      fast=context.loader != "inductor")


@dataclass(frozen=True)
class _Found:
    """What a load path found: the entry (trust-checked), its store, the model to bind and how
    to load it."""

    entry: Entry
    store: Store
    model: Any
    timings: Timings
    options: dict[str, Any]
    cudagraph: str = "piecewise"
    capture_sizes: Any = None


def _build(manifest: Manifest, timings: Timings) -> Any:
    t = time.perf_counter()
    model = build_model(manifest)
    timings.add("build model", time.perf_counter() - t)
    return model


def _by_key(key: str, model: Any, context: Context) -> _Found:
    if model is None:
        raise LoadError("loading by key needs `model=`: the module whose weights to bind")
    timings = Timings()
    tiered = context.open_tiered()
    entry = tiered.get(key, built_here=True)  # a key from elsewhere: built for this machine?
    timings.pulled_bytes = tiered.pulled_bytes
    return _Found(entry, tiered.local, model, timings, entry.factors.get("inductor", {}).get("patches", {}))


def _by_manifest(manifest: Manifest, model: Any, device: str | None, context: Context) -> _Found:
    timings = Timings()
    if device is not None and device != manifest.device:
        manifest = manifest.replace(device=device)
    tiered = context.open_tiered(manifest)
    machine = machine_factors(manifest.device, tiered.local.base / "toolchain")
    res = _resolve(manifest, tiered, timings, machine, record_miss=False)  # counted below
    if model is None and res.entry is None and res.corrupt is None and (
            differs_in_settings(res.diffs) or res.closest is None and tiered.remote is not None):
        # an entry compiled under the settings this model's build sets (torchao's quantize_
        # turns Inductor options on): keyed as they are once it is built — built first, then
        # (a remote's entries are not compared before a pull: with one, any miss builds)
        try:
            model = _build(manifest, timings)
            built, moved = reread_after_build(manifest, machine, tiered.local.base / "toolchain")
        except BaseException:
            res.record_miss(tiered.local)  # the miss stands: counted before the build's error
            raise
        if moved:
            res = _resolve(manifest, tiered, timings, built, record_miss=False)
    res.record_miss(tiered.local)  # one lookup's miss, if it stands
    entry = _entry_or_miss(res, manifest, tiered)
    if model is None:
        model = _build(manifest, timings)
    return _Found(entry, tiered.local, model, timings, dict(manifest.inductor), manifest.cudagraph,
                  manifest.capture_sizes)
