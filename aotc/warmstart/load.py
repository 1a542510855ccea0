"""A precompiled function at a warm start: :func:`precompiled` and the callable it returns.

``aotc.precompiled(model_or_fn)`` finds the stored entry behind the target's probe
(:mod:`aotc.warmstart.key`: local, else pulled from the remote, the trust policy enforced before a
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
from aotc.log import logger
from aotc.warmstart.callable import Precompiled, traced_path

__all__ = ["load_functions", "precompiled"]

_log = logger("warmstart")


def load_functions(entry: Any, tiered: Any, context: Any, module: str) -> list[Any]:
    """Dynamo's functions of a stored entry (trust-checked by ``tiered`` before this), each with
    the graph programs it calls loaded through ``context``."""
    from aotc.warmstart.key import ROLE_PREFIX

    roles = sorted((r for r in entry.blobs if r.startswith(ROLE_PREFIX)), key=lambda r: int(r[len(ROLE_PREFIX):]))
    functions = []
    for role in roles:
        fn = dyn.from_bytes(tiered.local.read_blob(entry, role), module)
        dyn.compiled_backend(fn).load_with(context)
        functions.append(fn)
    return functions


def precompiled(target: Callable[..., Any], *, name: str | None = None, store: Any = None, remote: Any = None,
                trust: Iterable[str] | str = (), device: str | None = None, dynamic: bool | None = None,
                precompile_missing: bool = True, **backend_options: Any) -> Precompiled:
    """``target`` (a module, bound method or function) as stored by :func:`aotc.precompile`
    (module doc). ``name``: the entry's name (default: the target's identity); ``store`` /
    ``remote`` / ``trust``: as :func:`aotc.backend`'s (default from the environment);
    ``device``: default the target's parameters'; ``dynamic``: for the traced path and a build
    at the first call; ``backend_options``: more :func:`aotc.backend` arguments for both."""
    from aotc.context import Context
    from aotc.errors import AotcError, StoreNotFoundError
    from aotc.log import configure
    from aotc.lookup.toolchain import machine_factors
    from aotc.warmstart.key import device_of, probe_for, target_id

    context = Context.from_env(store=store, remote=remote, trust=trust)  # an entry point
    configure(context.settings.log)
    identity, module = target_id(target)
    name = name or identity
    backend_kwargs = {"store": store, "remote": remote, "trust": trust, "name": name, **backend_options}
    traced = traced_path(target, backend_kwargs, dynamic)
    build = None
    if precompile_missing:
        def build(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Precompiled:
            from aotc.warmstart.build import precompile

            return precompile(target, [(args, kwargs)], name=name, store=store, remote=remote, trust=trust,
                              device=device, dynamic=dynamic, **backend_options)
    try:
        tiered = context.open_tiered(create=precompile_missing)
    except StoreNotFoundError as e:
        _log.info(f"aotc: precompiled {identity}: {e}")
        return Precompiled(target, identity, [], None, traced, build)
    try:
        probe = probe_for(identity, name, machine_factors(device or device_of(target),
                                                          tiered.local.base / "toolchain"))
        found = tiered.find_probe(probe, wait=False)
        if found.entry is None:
            why = "; ".join(d.describe() for d in found.diffs)[:300] or "none stored"
            _log.info(f"aotc: precompiled {identity}: no stored entry for this machine and these "
                      f"sources ({why})")
            return Precompiled(target, identity, [], None, traced, build, str(tiered.local.root))
        functions = load_functions(found.entry, tiered, context, module)
    except (AotcError, RuntimeError, ImportError, TypeError, ValueError, EOFError) as e:
        # refused, damaged, or Dynamo's pickle no longer matches this process: the traced path
        _log.warning(f"aotc: warning: precompiled {identity}: the stored entry is not used "
                     f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); calls are traced")
        return Precompiled(target, identity, [], None, traced)
    _log.info(f"aotc: precompiled {identity}: loaded {len(functions)} function(s) from "
              f"{found.entry.key[:16]}… (no trace)")
    return Precompiled(target, identity, functions, found.entry.key, traced, store=str(tiered.local.root))
