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

import threading
from collections.abc import Callable, Iterable
from typing import Any

from aotc._torch import precompile as dyn
from aotc.log import logger

__all__ = ["Precompiled", "load_functions", "precompiled"]

_log = logger("warmstart")


class Precompiled:
    """Dynamo's stored functions for one target, called like the target (module doc).
    ``key``: the entry they came from (None until one is stored); ``served`` / ``traced``:
    calls run by stored code / by the traced path."""

    def __init__(self, target: Callable[..., Any], identity: str, functions: list[Any], key: str | None,
                 traced: Callable[[], Callable[..., Any]],
                 build: Callable[[tuple[Any, ...], dict[str, Any]], Precompiled] | None = None) -> None:
        self.target, self.identity, self.functions, self.key = target, identity, list(functions), key
        _, self._bound = dyn.traced_function(target)
        self._make_traced, self._traced = traced, None
        self._build = build  # nothing stored: precompile at the first call
        self._lock = threading.Lock()
        self.served = self.traced = 0
        self.last_miss = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        full = args if self._bound is None else (self._bound, *args)
        for fn in self.functions:
            if dyn.guards_pass(fn, full, kwargs):
                self.served += 1
                return dyn.call(fn, full, kwargs)
        if not self.functions and self._build is not None:
            with self._lock:
                if not self.functions and self._build is not None:
                    self._build_now(args, kwargs)
            if self.functions:
                return self(*args, **kwargs)
        return self._trace(full, args, kwargs)

    def _build_now(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Precompile with this call's arguments (nothing was stored); a failure is one warning
        and the traced path."""
        from aotc.errors import AotcError

        build, self._build = self._build, None
        try:
            built = build(args, kwargs)  # type: ignore[misc]  # checked by the caller
        except AotcError as e:
            _log.warning(f"aotc: warning: precompiled {self.identity}: not precompiled ({e}); "
                         "calls are traced")
            return
        self.functions, self.key = built.functions, built.key

    def _trace(self, full: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._traced is None:
            with self._lock:
                if self._traced is None:
                    why = dyn.guard_failure(self.functions[0], full, kwargs) if self.functions \
                        else "nothing stored"
                    self.last_miss = why
                    _log.info(f"aotc: precompiled {self.identity}: not this call ({why}); it runs "
                              "through torch.compile(backend=aotc) (Dynamo traces it)")
                    self._traced = self._make_traced()
        self.traced += 1
        return self._traced(*args, **kwargs)

    def __repr__(self) -> str:
        key = "none stored" if self.key is None else f"key={self.key[:16]}…"
        return f"Precompiled({self.identity}, {len(self.functions)} functions, {key})"


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


def traced_path(target: Callable[..., Any], backend_kwargs: dict[str, Any], dynamic: bool | None) -> Callable[[], Any]:
    """How a call the stored code does not cover runs: ``torch.compile(target, backend=aotc)``."""

    def make() -> Any:
        import torch

        from aotc.backend.serve import backend

        return torch.compile(target, backend=backend(**backend_kwargs), dynamic=dynamic)

    return make


def precompiled(target: Callable[..., Any], *, name: str | None = None, store: Any = None, remote: Any = None,
                trust: Iterable[str] | str = (), device: str | None = None, dynamic: bool | None = None,
                precompile_missing: bool = True, **backend_options: Any) -> Precompiled:
    """``target`` (a module, bound method or function) as stored by :func:`aotc.precompile`
    (module doc). ``name``: the entry's name (default: the target's identity); ``store`` /
    ``remote`` / ``trust``: as :func:`aotc.backend`'s (default from the environment);
    ``device``: default the target's parameters'; ``dynamic``: for the traced path and a build
    at the first call; ``backend_options``: more :func:`aotc.backend` arguments for both."""
    from aotc.context import Context
    from aotc.errors import AotcError
    from aotc.log import configure
    from aotc.lookup.toolchain import machine_factors
    from aotc.warmstart.key import device_of, probe_for, target_id

    context = Context.from_env(store=store, remote=remote, trust=trust)  # an entry point
    configure(context.settings.log)
    identity, module = target_id(target)
    name = name or identity
    backend_kwargs = {"store": store, "remote": remote, "trust": trust, "name": name, **backend_options}
    traced = traced_path(target, backend_kwargs, dynamic)
    tiered = context.open_tiered(create=precompile_missing)
    probe = probe_for(identity, name, machine_factors(device or device_of(target), tiered.local.base / "toolchain"))
    functions: list[Any] = []
    key = None
    try:
        found = tiered.find_probe(probe, wait=False)
        if found.entry is not None:
            functions, key = load_functions(found.entry, tiered, context, module), found.entry.key
            _log.info(f"aotc: precompiled {identity}: loaded {len(functions)} function(s) from "
                      f"{key[:16]}… (no trace)")
        else:
            why = "; ".join(d.describe() for d in found.diffs)[:300] or "none stored"
            _log.info(f"aotc: precompiled {identity}: no stored entry for this machine and these "
                      f"sources ({why})")
    except (AotcError, RuntimeError, ImportError, TypeError, ValueError, EOFError) as e:
        # refused, damaged, or Dynamo's pickle no longer matches this process: the traced path
        _log.warning(f"aotc: warning: precompiled {identity}: the stored entry is not used "
                     f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); calls are traced")
        return Precompiled(target, identity, [], None, traced)

    build = None
    if not functions and precompile_missing:
        def build(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Precompiled:
            from aotc.warmstart.build import precompile

            return precompile(target, [(args, kwargs)], name=name, store=store, remote=remote, trust=trust,
                              device=device, dynamic=dynamic, **backend_options)
    return Precompiled(target, identity, functions, key, traced, build)
