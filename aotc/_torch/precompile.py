"""Dynamo's own AOT compile (``torch._dynamo.aot_compile``): one fullgraph trace of a function
whose output — the bytecode Dynamo wrote, its guards and the backend's ``SerializableCallable`` —
is saved as bytes and loaded in another process with no trace. Tested on torch 2.13 (the module
exists from 2.10; :func:`supported` feature-checks it).

What aotc adds to torch's own ``aot_compile_fullgraph``:

* **Guards kept.** torch's default filter drops every guard on a global; here a global's value
  guards (a constant, a type, a tensor's metadata, a length, a dict's keys) are kept, so a changed
  module constant fails the guard instead of running stale bytecode. Guards that cannot be saved
  (object identities: ``ID_MATCH``, ``CLASS_MATCH``, ``FUNCTION_MATCH``, …) name objects of the
  tracing process: those reached through a class, a closure or code are left out (that code is
  in aotc's key as the traced source files' hashes); those on the called objects' own state (an
  attribute holding a function, an enum, a module) become identity checks by stable name,
  evaluated at every call (:func:`guards_pass`); one with no stable name refuses the capture.
* **Globals Dynamo installed.** The bytecode may load a module through a global Dynamo added to
  the traced function's module (``___module_collections_…``); it is recorded as an import so a
  fresh process finds it.
* **Tensor-subclass weights' guards saved** (torchao's ``Int8Tensor``): two gaps of Dynamo's
  guard pickler filled while a capture saves them (:func:`_saveable_subclass_guards`).
* **Loading** passes the traced function's module globals (a guard on ``G['torch']`` reads them).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["capture", "call", "compiled_backend", "dynamo_config_values", "from_bytes", "global_state",
           "guard_failure", "guards_pass", "identities", "set_identities", "source_modules", "stable_name",
           "supported", "to_bytes", "traced_function"]

# guard types on a global kept: they compare values, which a fresh process can check again
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "TYPE_MATCH", "TENSOR_MATCH", "SEQUENCE_LENGTH",
                           "DICT_KEYS_MATCH", "LENGTH_CHECK", "TUPLE_ITERATOR_LEN", "BOOL_MATCH", "NONE_MATCH",
                           "DICT_NOT_CONTAINS", "NOT_PRESENT_IN_GENERIC_DICT", "DICT_CONTAINS"})
_RESTARTS = 3  # traces again Dynamo may ask for (each restart records what it must do otherwise)
# Dynamo settings that change no trace: locations, logging, limits that only stop recompiles
_CONFIG_DENY = frozenset({"base_dir", "debug_dir_root", "cprofile", "verbose", "recompile_limit",
                          "accumulated_recompile_limit", "cache_size_limit", "accumulated_cache_size_limit"})


def supported() -> bool:
    """Whether this torch has Dynamo's AOT compile (``torch._dynamo.aot_compile``)."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph  # noqa: F401
    except ImportError:
        return False
    return True


def traced_function(target: Callable[..., Any]) -> tuple[types.FunctionType, Any]:
    """The plain function Dynamo traces for ``target`` and the object bound to it (None for a
    plain function): a module is traced through its ``__call__`` (its hooks and its decorated
    ``forward`` inlined; the saved code has no closure to pickle)."""
    if isinstance(target, torch.nn.Module):
        target = target.__call__
    if isinstance(target, types.MethodType):
        return target.__func__, target.__self__  # type: ignore[return-value]  # a method of Python code
    if isinstance(target, types.FunctionType):
        return target, None
    raise TypeError(f"cannot precompile {target!r}: give a function, a bound method or an nn.Module")


# a dropped identity guard whose source goes through a class, a closure or code: the code is in
# aotc's key (the traced files' hashes); any other (an instance attribute holding a function, an
# enum, a module) is state of the objects called, checked again by name at every call
_CODE_LEVEL = ("type(", "__class__", "__closure__", "__code__", "__mro__", "__defaults__", "__kwdefaults__",
               "__func__", "__globals__", "__dict__)")


def stable_name(value: Any) -> str | None:
    """A name for ``value`` that is the same in another process (a module, a function or class
    by module and qualified name, an enum member, a plain constant); ``"nn.Module"`` for a module
    instance (its own guards cover it); None when it has none."""
    import enum

    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, torch.nn.Module):
        return "nn.Module"
    if isinstance(value, enum.Enum):
        return f"enum:{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    mod, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(mod, str) and isinstance(qual, str) and "<locals>" not in qual:
        return f"{mod}.{qual}"
    return None


def _guard_filter(identities: list[tuple[str, str]]) -> Callable[[Sequence[Any]], Sequence[bool]]:
    """Dynamo's guard filter (module doc); identity guards on the called objects' state that it
    drops are appended to ``identities`` as ``(source, stable name)``; one whose value has no
    stable name raises ``TypeError`` (it cannot be checked in another process)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)

    def keep(entries: Sequence[Any]) -> Sequence[bool]:
        out = []
        for g in entries:
            if not (g.guard_type in unsaveable or unsaveable & set(g.derived_guard_types)):
                out.append(not g.is_global or g.guard_type in _VALUE_GUARDS)
                continue
            out.append(False)
            source = str(getattr(g.orig_guard, "name", "") or "")
            if g.is_global or not source or any(p in source for p in _CODE_LEVEL):
                continue
            name = stable_name(g.value) if g.has_value else None
            if name is None:
                raise TypeError(f"Dynamo guards the identity of {source} ({type(g.value).__name__}), which "
                                "cannot be checked in another process")
            if name != "nn.Module" and (source, name) not in identities:
                identities.append((source, name))
        return out

    return keep


def identities(compiled: Any) -> list[list[str]]:
    """The identity checks a captured (or loaded) function carries, as ``[source, name]`` pairs."""
    return [list(x) for x in getattr(compiled, "_aotc_identities", ())]


def set_identities(compiled: Any, pairs: Any) -> None:
    """Attach the identity checks recorded with a stored function (``[source, name]`` pairs)."""
    checks = [(str(src), str(name)) for src, name in (pairs or [])]
    compiled._aotc_identities = checks
    compiled._aotc_checks = [(compile(src, "<aotc identity guard>", "eval"), name) for src, name in checks]


def _identities_hold(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    checks = getattr(compiled, "_aotc_checks", ())
    if not checks:
        return True
    scope = {"L": compiled.prepare_f_locals(*args, **kwargs)}
    for code, name in checks:
        try:
            value = eval(code, {"__builtins__": {}}, scope)  # noqa: S307 - a guard source Dynamo wrote
        except Exception:  # noqa: BLE001 - the attribute is gone: the guard fails
            return False
        if stable_name(value) != name:
            return False
    return True


def capture(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            backend: Callable[..., Any], dynamic: bool | None) -> Any:
    """One fullgraph trace of ``target`` on ``(args, kwargs)`` handing the graph to
    ``backend`` (which must return a ``SerializableCallable``): torch's ``AOTCompiledFunction``,
    ready to call and to :func:`to_bytes`. A graph break raises Dynamo's error. Dynamo's request
    to trace again (``RestartAnalysis``: a float it must specialize, say) is honoured as
    ``torch.compile`` does, up to :data:`_RESTARTS` times."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.exc import RestartAnalysis
    from torch._dynamo.hooks import Hooks

    fn, bound = traced_function(target)
    method = types.MethodType(fn, bound) if bound is not None else fn
    with _compile_lock(), _saveable_subclass_guards():  # Dynamo's lock: a torch.compile trace in another thread waits
        for attempt in range(_RESTARTS + 1):
            found: list[tuple[str, str]] = []
            try:
                compiled = aot_compile_fullgraph(method, (tuple(args), dict(kwargs)),
                                                 hooks=Hooks(guard_filter_fn=_guard_filter(found)),
                                                 backend=backend, dynamic=dynamic)
                break
            except RestartAnalysis:
                if attempt == _RESTARTS:
                    raise
    _record_installed_modules(compiled)
    set_identities(compiled, found)
    compiled.disable_guard_check()  # checked once per call by guards_pass
    return compiled


class _MetaLikeSubclass(torch.overrides.TorchFunctionMode):
    """``torch.empty_like(x, device="meta")`` for a tensor subclass that does not implement it:
    the subclass rebuilt from meta copies of its inner tensors (what Dynamo's unpickler reads of
    it: its type, shape and strides)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.empty_like or not args or str(kwargs.get("device")) != "meta":
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except NotImplementedError:
            obj = args[0]
            attrs, ctx = obj.__tensor_flatten__()
            inner = {a: torch.empty_like(getattr(obj, a), device="meta") for a in attrs}
            return type(obj).__tensor_unflatten__(inner, ctx, obj.shape, obj.stride())


@contextlib.contextmanager
def _saveable_subclass_guards() -> Iterator[None]:
    """Dynamo's guard pickler (``GuardsStatePickler``, torch 2.13) with two gaps filled, while a
    capture saves its guards, for tensor-subclass weights (torchao's ``Int8Tensor``): it makes a
    meta copy of a subclass with ``empty_like``, which the subclass may not implement
    (:class:`_MetaLikeSubclass`); and it names a bound method's function by ``__name__``, which a
    ``functools.partial`` lacks (torchao replaces each quantized Linear's ``extra_repr`` with one):
    saved as (function, instance), as the pickler saves any rebound method. Only what torch would
    raise on is handled; a torch without the pickler is left as it is."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    try:
        from torch._dynamo.guards import GuardsStatePickler
    except ImportError:
        yield
        return
    original = getattr(GuardsStatePickler, "reducer_override", None)
    rebind = getattr(GuardsStatePickler, "_unpickle_bound_method", None)
    if original is None or rebind is None:
        yield
        return

    def reducer_override(self: Any, obj: Any) -> Any:
        if inspect.ismethod(obj) and not hasattr(obj.__func__, "__name__"):
            return rebind, (obj.__func__, obj.__self__)
        if isinstance(obj, torch.Tensor) and is_traceable_wrapper_subclass(obj):
            with _MetaLikeSubclass():
                return original(self, obj)
        return original(self, obj)

    GuardsStatePickler.reducer_override = reducer_override  # type: ignore[method-assign]
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = original  # type: ignore[method-assign]


def _compile_lock() -> Any:
    """Dynamo's compile lock (``torch._dynamo.convert_frame.compile_lock``), or a no-op."""
    from torch._dynamo import convert_frame

    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def _record_installed_modules(compiled: Any) -> None:
    """Globals Dynamo installed in the traced module that the bytecode loads: a module becomes
    an import of the saved code; anything else cannot be saved (raises ``TypeError``)."""
    import builtins

    env = compiled._artifacts.runtime_env
    scope = compiled._extra_globals or {}
    for ref in sorted(env.external_refs):
        if ref in env.import_sources or ref in env.used_globals or hasattr(builtins, ref) \
                or ref == compiled._artifacts.backend_id or not ref.startswith("___"):
            continue
        value = scope.get(ref)
        if isinstance(value, types.ModuleType):
            env.import_sources[ref] = value.__name__
        elif value is not None:
            raise TypeError(f"Dynamo's code loads {ref} ({type(value).__name__}), a global it installed "
                            "while tracing that cannot be saved")


def to_bytes(compiled: Any) -> bytes:
    """The saved form of a :func:`capture` result (a pickle: load only trusted bytes)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AOTCompiledFunction.serialize(compiled).serialized_data


def from_bytes(data: bytes, module: str) -> Any:
    """A saved function back, with no trace: its guards and code rebuilt against the globals of
    ``module`` (the traced function's), the backend's callable deserialized (not yet loaded)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    scope = importlib.import_module(module).__dict__
    compiled = AOTCompiledFunction.deserialize(data, f_globals=scope)
    compiled.disable_guard_check()
    return compiled


def compiled_backend(compiled: Any) -> Any:
    """The backend's callable inside a function Dynamo's AOT compile made (aotc's
    ``AotcCompiled``; vLLM's saved ``model.aot_compiled_fn`` too); None for anything else."""
    return getattr(getattr(compiled, "_artifacts", None), "compiled_fn", None)


def source_modules(compiled: Any) -> list[str]:
    """The modules whose code Dynamo inlined (their source is what the bytecode depends on)."""
    return sorted({s.module for s in compiled._artifacts.source_info.inlined_sources})


def guards_pass(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether Dynamo's guards and the identity checks hold for this call (``args`` with the
    bound object first)."""
    return bool(compiled.guard_check(*args, **kwargs)) and _identities_hold(compiled, args, kwargs)


def guard_failure(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The first failing guard of this call, in one line."""
    try:
        if compiled.guard_check(*args, **kwargs):  # Dynamo's hold: an identity check failed
            scope = {"L": compiled.prepare_f_locals(*args, **kwargs)}
            for code, name in getattr(compiled, "_aotc_checks", ()):
                try:
                    now = stable_name(eval(code, {"__builtins__": {}}, scope))  # noqa: S307 - Dynamo's source
                except Exception:  # noqa: BLE001 - gone
                    now = "missing"
                if now != name:
                    return f"{_source_of(compiled, code)} is {now}, not {name}"
        info = compiled._artifacts.guard_manager.check_verbose(compiled.prepare_f_locals(*args, **kwargs))
        parts = list(getattr(info, "verbose_code_parts", []) or [])
        return " ".join(str(parts[0]).split())[:200] if parts else "a guard failed"
    except TypeError as e:  # the arguments do not bind to the traced signature
        return str(e)


def _source_of(compiled: Any, code: Any) -> str:
    for (src, _), (c, _) in zip(getattr(compiled, "_aotc_identities", ()), getattr(compiled, "_aotc_checks", ())):
        if c is code:
            return src
    return "an identity"


def call(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the saved code (guards already checked)."""
    return compiled.fn(*args, **kwargs)


def global_state() -> dict[str, Any]:
    """The global torch state a trace records (Dynamo guards it at every call)."""
    state: dict[str, Any] = {"grad": torch.is_grad_enabled(), "inference_mode": torch.is_inference_mode_enabled(),
                             "default_dtype": str(torch.get_default_dtype()),
                             "deterministic": torch.are_deterministic_algorithms_enabled()}
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            state[f"autocast_{device}"] = str(torch.get_autocast_dtype(device))
    return state


def _canonical(value: Any, name: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, name) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(str(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _canonical(v, name) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    raise TypeError(f"Dynamo setting {name} = {value!r} has no stable spelling for aotc's key")


def dynamo_config_values() -> dict[str, Any]:
    """Dynamo's settings as this process traces with them (its portable config minus locations
    and limits), canonical and JSON-able; ``TypeError`` on a value with no stable spelling."""
    import torch._dynamo.config as config

    return {k: _canonical(v, k) for k, v in sorted(config.save_config_portable().items())
            if k not in _CONFIG_DENY and k != "TYPE_CHECKING"}
