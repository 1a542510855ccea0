"""The callable a precompiled target becomes: Dynamo's stored functions, each call checked against
their guards and run by the stored code; a call none covers runs through
``torch.compile(target, backend=aotc)`` (the traced path, one INFO line); with nothing stored,
the first call precompiles with its own arguments (:mod:`aotc.dynamo_artifacts.build`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

from aotc._torch import precompile as dyn
from aotc.log import logger

__all__ = ["Precompiled", "traced_path"]

_log = logger("precompile")


class Precompiled:
    """Dynamo's stored functions for one target, called like the target (module doc).
    ``key``: the entry they came from (None until one is stored); ``served`` / ``traced``:
    calls run by stored code / by the traced path."""

    def __init__(self, target: Callable[..., Any], identity: str, functions: list[Any], key: str | None,
                 traced: Callable[[], Callable[..., Any]],
                 build: Callable[[tuple[Any, ...], dict[str, Any]], Precompiled] | None = None,
                 store: str = "") -> None:
        self.target, self.identity, self.functions, self.key = target, identity, list(functions), key
        self.store = store  # the local store it came from (or went to)
        _, self._bound = dyn.traced_function(target)
        self._make_traced = traced
        self._traced: Callable[..., Any] | None = None
        self._build = build  # nothing stored: precompile at the first call
        self._lock, self._count_lock = threading.Lock(), threading.Lock()
        self.served = self.traced = 0
        self.last_miss = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        full = args if self._bound is None else (self._bound, *args)
        fn = self._covering(full, kwargs)
        if fn is None:
            with self._lock:  # one first-call build; the traced path made once
                if self._build is not None and not self.functions:
                    self._build_now(args, kwargs)
                fn = self._covering(full, kwargs)  # what this thread, or another, just stored
                if fn is None and self._traced is None:
                    self._make_traced_path(full, kwargs)
        with self._count_lock:
            if fn is not None:
                self.served += 1
            else:
                self.traced += 1
        if fn is not None:
            return dyn.call(fn, full, kwargs)
        return cast(Callable[..., Any], self._traced)(*args, **kwargs)  # made under the lock above

    def _covering(self, full: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The stored function whose guards hold for this call, or None."""
        for fn in self.functions:
            if dyn.guards_pass(fn, full, kwargs):
                return fn
        return None

    @property
    def graph_keys(self) -> list[str]:
        """The graph entries the stored functions call."""
        return [dyn.compiled_backend(fn).key for fn in self.functions]

    def _build_now(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Precompile with this call's arguments (nothing was stored); any failure is one
        warning and the traced path (the caller's process lives on)."""
        build, self._build = self._build, None
        try:
            built = build(args, kwargs)  # type: ignore[misc]  # checked by the caller
        except Exception as e:  # noqa: BLE001 - the safety net of a user's first call
            _log.warning(f"aotc: warning: precompiled {self.identity}: not precompiled ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}); calls are traced")
            return
        self.functions, self.key, self.store = built.functions, built.key, built.store

    def _make_traced_path(self, full: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        why = dyn.guard_failure(self.functions[0], full, kwargs) if self.functions else "nothing stored"
        self.last_miss = why
        _log.info(f"aotc: precompiled {self.identity}: not this call ({why}); it runs through "
                  "torch.compile(backend=aotc) (Dynamo traces it)")
        self._traced = self._make_traced()

    def __repr__(self) -> str:
        key = "none stored" if self.key is None else f"key={self.key[:16]}…"
        return f"Precompiled({self.identity}, {len(self.functions)} functions, {key})"


def traced_path(target: Callable[..., Any], backend_kwargs: dict[str, Any], dynamic: bool | None) -> Callable[[], Any]:
    """How a call the stored code does not cover runs: ``torch.compile(target, backend=aotc)``."""

    def make() -> Any:
        import torch

        from aotc.backend.serve import backend

        return torch.compile(target, backend=backend(**backend_kwargs), dynamic=dynamic)

    return make
