"""The key of a precompiled function (Dynamo's output stored as an entry).

What Dynamo's bytecode and guards depend on, in two parts, as a manifest's key is:

* the **probe** (:class:`aotc.lookup.resolve.Probe`), known before any trace — what is traced
  (the function, and the class of the object it is bound to), the entry's name, ``dynamic`` and
  the backend options given, this machine's toolchain (torch, Python, compiler, device), Dynamo's
  settings, aotc's format and compile code;
* what only the trace knows, recorded in the entry — ``code``: the sha256 of every source file
  Dynamo inlined (torch and the stdlib are in the toolchain); ``inputs``: the example inputs'
  specs; ``global_state``: grad mode, default dtype, autocast …; ``graphs``: the graph entries
  the saved code calls; ``identities``: the identity checks by stable name standing for guards
  Dynamo cannot save.

A load finds the newest entry behind the probe whose recorded files still hash the same here
(a changed file is a miss, ``aotc explain`` says which); the recorded inputs and global state
are checked again at every call by Dynamo's own guards.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aotc.lookup.compile_logic import compile_logic_hash
from aotc.lookup.filehash import file_sha256, is_toolchain_file
from aotc.lookup.resolve import Probe, inductor_factors
from aotc.records.key import FORMAT_VERSION

__all__ = ["KIND", "RECORDED", "ROLE_PREFIX", "base_factors", "device_of", "full_factors", "input_specs",
           "module_sources", "named_target", "probe_for", "target_id"]

KIND = "precompiled"
ROLE_PREFIX = "dynamo."  # blob roles: dynamo.0, dynamo.1, … (one per example input)


def named_target(target: Callable[..., Any]) -> tuple[str, str]:
    """:func:`target_id` for a front door: a target with no stable name is a ``PrecompileError``."""
    from aotc.errors import PrecompileError

    try:
        return target_id(target)
    except TypeError as e:
        raise PrecompileError(str(e)) from e


def target_id(target: Callable[..., Any]) -> tuple[str, str]:
    """``(identity, module)`` of what is traced: ``pkg.Class`` for a module (called whole),
    ``pkg.Class:pkg.mod.func`` for another bound method (its class, then the function),
    ``pkg.mod.func`` for a function; ``module``: where the traced function lives (its globals
    rebuild the saved code)."""
    import torch

    from aotc._torch.precompile import traced_function

    fn, bound = traced_function(target)
    owner = "" if bound is None else f"{type(bound).__module__}.{type(bound).__qualname__}"
    if isinstance(bound, torch.nn.Module) and fn is type(bound).__call__:
        return owner, fn.__module__
    func = f"{fn.__module__}.{fn.__qualname__}"
    return (f"{owner}:{func}" if owner else func), fn.__module__


def device_of(target: Callable[..., Any]) -> str:
    """The device type a target computes on: its module's first parameter's, else ``cpu``."""
    from aotc._torch.precompile import traced_function

    _, bound = traced_function(target)
    for p in getattr(bound, "parameters", lambda: iter(()))():
        return str(p.device.type)
    return "cpu"


# what a precompiled entry records beyond the probe and its code (module doc)
RECORDED = ("inputs", "global_state", "graphs", "identities")


def _canonical_options(options: dict[str, Any]) -> Any:
    """The backend options as JSON (sets and tuples as lists); ``TypeError`` for a value with no
    stable spelling — never a silently different key."""
    import json

    def plain(v: Any) -> Any:
        if isinstance(v, (set, frozenset)):
            return sorted(plain(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"backend option value {v!r} has no stable spelling for aotc's key")

    out = {k: plain(v) for k, v in sorted(options.items()) if v is not None}
    json.dumps(out)
    return out


def base_factors(identity: str, name: str, machine: dict[str, Any], dynamic: bool | None = None,
                 options: dict[str, Any] | None = None, device: str = "cpu") -> dict[str, Any]:
    """Every factor known before a trace (module doc); ``machine``:
    :func:`aotc.lookup.toolchain.machine_factors` for ``device``; ``dynamic`` and the backend
    ``options`` as ``precompile`` was given them (they change what is traced and compiled). The
    Inductor settings and torch's process-wide settings enter too: the stored code calls graph
    entries by the keys they had under them."""
    from aotc._torch.precompile import dynamo_config_values

    return {"precompiled": {"target": identity, "name": name, "dynamic": dynamic,
                            "backend": _canonical_options(options or {})},
            "toolchain": machine["toolchain"], "dynamo": dynamo_config_values(),
            "inductor": inductor_factors({}, machine["inductor_values"], device),
            "global": machine["global"],
            "aotc": {"format": FORMAT_VERSION, "compile_logic": compile_logic_hash(), "kind": KIND}}


def probe_for(identity: str, name: str, machine: dict[str, Any], dynamic: bool | None = None,
              options: dict[str, Any] | None = None, device: str = "cpu") -> Probe:
    """The lookup of a precompiled ``identity`` named ``name`` on ``machine`` (for ``device``)."""
    return Probe(name, base_factors(identity, name, machine, dynamic, options, device), recorded=RECORDED)


def _module_file(module: str) -> str | None:
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        path = None if spec is None else spec.origin
    return path if path and os.path.isfile(path) else None


def module_sources(modules: Iterable[str]) -> dict[str, str]:
    """``{relative path: sha256}`` of each module's source file (``pkg/sub/mod.py``, found again
    on any machine by :func:`aotc.lookup.resolve.locate_source`), torch and the stdlib left out.
    Raises ``ValueError`` for a module whose code has no ``.py`` file to hash (a ``.pyc``-only or
    zipped deployment, ``python -c``): its code could change under the same key."""
    out: dict[str, str] = {}
    for module in sorted(set(modules)):
        path = _module_file(module)
        if path is not None and is_toolchain_file(path):
            continue
        if path is None or not path.endswith(".py"):
            raise ValueError(f"module {module} has no source file to key its code by (loaded from "
                             f"{path or 'nowhere on disk'}); precompile code that ships as .py files")
        if module == "__main__":
            out[os.path.basename(path)] = file_sha256(path)  # type: ignore[arg-type]  # a str path
            continue
        tail = "/__init__.py" if os.path.basename(path) == "__init__.py" else ".py"
        out[module.replace(".", "/") + tail] = file_sha256(path)  # type: ignore[arg-type]  # a str path
    return out


def _spec(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype), "device": value.device.type,
                "grad": bool(value.requires_grad)}
    if isinstance(value, (list, tuple)):
        return [_spec(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _spec(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"object": f"{type(value).__module__}.{type(value).__qualname__}"}


def input_specs(example_inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
    """What each example input is (tensors by shape, dtype and device; plain values as they are;
    other objects by type), JSON-able."""
    return [{"args": _spec(list(args)), "kwargs": _spec(dict(kwargs))} for args, kwargs in example_inputs]


def full_factors(base: dict[str, Any], code: dict[str, str], inputs: list[Any], state: dict[str, Any],
                 graphs: list[str], identities: list[Any]) -> dict[str, Any]:
    """``base`` and what the trace recorded (module doc; ``identities``: per function, the
    identity checks by stable name :mod:`aotc._torch.precompile` made of guards it cannot save)."""
    return {**base, "code": dict(sorted(code.items())), "inputs": inputs, "global_state": state,
            "graphs": list(graphs), "identities": identities}
