"""A precompiled function at a warm start: :func:`precompiled` and the callable it returns.

``aotc.precompiled(model_or_fn)`` finds the stored entry behind the target's probe
(:mod:`aotc.dynamo_artifacts.key`: local, else pulled from the remote, the trust policy enforced before a
byte of Dynamo's pickle is read), rebuilds Dynamo's code and guards from it and loads the graph
programs that code calls — no Dynamo trace, no Inductor, no compiler. Each call checks Dynamo's
guards and runs the stored code. A call whose guards fail (another shape class, another dtype, a
changed module constant) goes through ``torch.compile(target, backend=aotc)`` instead — one INFO
line, the traced path, never a wrong answer. Nothing stored yet: the first call precompiles with
its own arguments as the example input and stores it (``precompile_missing``), so the next
process starts warm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from aotc._torch import precompile as dyn
from aotc.dynamo_artifacts.callable import Precompiled, traced_path
from aotc.gc_pause import gc_paused
from aotc.log import logger

__all__ = ["load_functions", "precompiled"]

_log = logger("precompile")


def load_functions(entry: Any, tiered: Any, context: Any, module: str) -> list[Any]:
    """Dynamo's functions of a stored entry (trust-checked by ``tiered`` before this), each with
    its identity checks and the graph programs it calls loaded through ``context``."""
    from aotc.dynamo_artifacts.key import ROLE_PREFIX
    from aotc.errors import LoadError

    roles = sorted((r for r in entry.blobs if r.startswith(ROLE_PREFIX)), key=lambda r: int(r[len(ROLE_PREFIX):]))
    checks = entry.factors.get("identities", [])
    if not roles or len(checks) != len(roles):
        raise LoadError(f"entry {entry.key[:16]}… is not a precompiled function this aotc reads")
    functions = []
    for role, pairs in zip(roles, checks):
        fn = dyn.from_bytes(tiered.local.read_blob(entry, role), module)
        dyn.set_identities(fn, pairs)
        backend = dyn.compiled_backend(fn)
        if not hasattr(backend, "load_with"):
            raise LoadError(f"entry {entry.key[:16]}… calls {type(backend).__name__}, not an aotc graph")
        backend.load_with(context)
        functions.append(fn)
    return functions


def precompiled(target: Callable[..., Any], *, name: str | None = None, store: Any = None, remote: Any = None,
                trust: Iterable[str] | str = (), device: str | None = None, dynamic: bool | None = None,
                precompile_missing: bool = True, **backend_options: Any) -> Precompiled:
    """``target`` (a module, bound method or function) as stored by :func:`aotc.precompile`
    (module doc). ``name``: the entry's name (default: the target's identity); ``dynamic`` and
    ``backend_options`` (more :func:`aotc.backend` arguments): as the entry was precompiled with
    (they are in its key), and for the traced path; ``store`` / ``remote`` / ``trust``: as
    :func:`aotc.backend`'s (default from the environment); ``device``: default the target's
    parameters'. A bad ``target`` raises ``PrecompileError``; anything that goes wrong finding or
    loading the entry is one warning line, and the calls are traced."""
    from aotc.context import Context
    from aotc.dynamo_artifacts.key import named_target
    from aotc.log import configure

    context = Context.from_env(store=store, remote=remote, trust=trust)  # an entry point
    configure(context.settings.log)
    identity, module = named_target(target)
    name = name or identity
    traced = traced_path(target, {"store": store, "remote": remote, "trust": trust, "name": name,
                                  **backend_options}, dynamic)

    def build(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Precompiled:
        from aotc.dynamo_artifacts.build import precompile

        return precompile(target, [(args, kwargs)], name=name, store=store, remote=remote, trust=trust,
                          device=device, dynamic=dynamic, **backend_options)

    try:
        return _find_and_load(target, identity, module, name, context, device, dynamic, backend_options,
                              traced, build if precompile_missing else None)
    except Exception as e:  # noqa: BLE001 - refused, damaged, unreadable, Dynamo's pickle no longer matching
        _log.warning(f"aotc: warning: precompiled {identity}: the stored entry is not used "
                     f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); calls are traced")
        return Precompiled(target, identity, [], None, traced)


def _find_and_load(target: Callable[..., Any], identity: str, module: str, name: str, context: Any,
                   device: str | None, dynamic: bool | None, options: dict[str, Any], traced: Any,
                   build: Any) -> Precompiled:
    from aotc.dynamo_artifacts.key import device_of, probe_for
    from aotc.errors import StoreNotFoundError
    from aotc.lookup.toolchain import machine_factors

    try:
        tiered = context.open_tiered(create=build is not None)
    except StoreNotFoundError as e:
        _log.info(f"aotc: precompiled {identity}: {e}")
        return Precompiled(target, identity, [], None, traced, build)
    if build is not None and not tiered.can_sign:
        _log.info(f"aotc: precompiled {identity}: a trust policy is set and this process has no trusted "
                  "signing key: nothing is precompiled here (set AOTC_SIGNING_KEY)")
        build = None
    dev = device or device_of(target)
    probe = probe_for(identity, name, machine_factors(dev, tiered.local.base / "toolchain"), dynamic, options, dev)
    found = tiered.find_probe(probe, wait=False)
    if found.entry is None:
        why = "; ".join(d.describe() for d in found.diffs)[:300] or "none stored"
        _log.info(f"aotc: precompiled {identity}: no stored entry for this machine and these sources ({why})")
        return Precompiled(target, identity, [], None, traced, build, str(tiered.local.root))
    with gc_paused():
        functions = load_functions(found.entry, tiered, context, module)
    _log.info(f"aotc: precompiled {identity}: loaded {len(functions)} function(s) from "
              f"{found.entry.key[:16]}… (no trace)")
    return Precompiled(target, identity, functions, found.entry.key, traced, store=str(tiered.local.root))
