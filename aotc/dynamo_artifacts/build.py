"""``aotc.precompile``: Dynamo's output stored as an entry, so a warm start does not trace.

For each example input, one fullgraph Dynamo trace of the target with aotc as the backend
(:mod:`aotc._torch.precompile`): the graph is compiled (or found) and stored as any backend graph
is, and Dynamo's bytecode and guards come back as bytes. The bytes of every example input go into
one entry (blob roles ``dynamo.0``, ``dynamo.1``, …) keyed by :mod:`aotc.dynamo_artifacts.key` and
stored through the tiered store's one journey (:meth:`~aotc.fleet.tiered.TieredStore.get_or_build`
by that key: local → the node's build lease → remote → put, signed when a signing key is set →
push), as the graph entries it calls were: two processes precompiling the same function on one
node compile its graphs once (the backend's lease) and store its artifact once (this one's).
:func:`aotc.precompiled` loads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aotc._torch import precompile as dyn
from aotc.errors import AotcError, PrecompileError
from aotc.log import logger

__all__ = ["example_input", "precompile"]

_log = logger("precompile")


def example_input(value: Any, where: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One example input as ``(args, kwargs)``: a tuple of positional arguments, a dict of
    keyword arguments, a pair ``(tuple, dict)``, or one tensor."""
    import torch

    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (tuple, list)) \
            and isinstance(value[1], dict):
        return tuple(value[0]), dict(value[1])
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    raise PrecompileError(f"{where}: expected a tuple of arguments, a dict of keyword arguments, "
                          f"(args, kwargs) or a tensor, got {type(value).__name__}")


def precompile(target: Callable[..., Any], example_inputs: Sequence[Any], *, name: str | None = None,
               store: Any = None, remote: Any = None, trust: Iterable[str] | str = (),
               device: str | None = None, dynamic: bool | None = None, **backend_options: Any) -> Any:
    """Trace ``target`` (a module, bound method or function) once per example input with aotc as
    the backend and store Dynamo's output (module doc); returns the
    :class:`~aotc.dynamo_artifacts.load.Precompiled` callable, ready. ``dynamic``: as ``torch.compile``'s
    (None: static shapes, each example input its own shape class); ``name``, ``store``,
    ``remote``, ``trust``, ``device``: as :func:`aotc.precompiled`; ``backend_options``: more
    :func:`aotc.backend` arguments (``compile_sizes``, ``inductor``, …). Raises
    ``PrecompileError`` for a graph break or a graph aotc cannot serve — it never falls back:
    what it stores must be aotc's."""
    from aotc.backend.serve import backend, kernel_header_window
    from aotc.context import Context
    from aotc.dynamo_artifacts.callable import Precompiled, traced_path
    from aotc.dynamo_artifacts.key import (
        KIND,
        ROLE_PREFIX,
        device_of,
        full_factors,
        input_specs,
        module_sources,
        named_target,
        probe_for,
    )
    from aotc.fleet.tiered import Wanted
    from aotc.log import configure
    from aotc.lookup.toolchain import machine_factors, remember_fresh_values
    from aotc.records.key import compute_key

    if not dyn.supported():
        import torch

        raise PrecompileError(f"torch {torch.__version__} has no Dynamo AOT compile "
                              "(torch._dynamo.aot_compile, torch >= 2.10): precompile needs it")
    if not example_inputs:
        raise PrecompileError("aotc.precompile(…, example_inputs=[…]): give at least one example input")
    context = Context.from_env(store=store, remote=remote, trust=trust)  # an entry point
    configure(context.settings.log)
    identity, module = named_target(target)
    name = name or identity
    inputs = [example_input(v, f"example_inputs[{i}]") for i, v in enumerate(example_inputs)]
    tiered = context.open_tiered(create=True)  # a bad AOTC_SIGNING_KEY fails here
    _check_signable(tiered, identity)
    dev = device or device_of(target)
    try:
        probe = probe_for(identity, name, machine_factors(dev, tiered.local.base / "toolchain"),
                          dynamic, backend_options, dev)
    except TypeError as e:
        raise PrecompileError(f"{identity}: {e}") from e
    backend_kwargs = {"store": store, "remote": remote, "trust": trust, "name": name, **backend_options}
    be = backend(**{**backend_kwargs, "fallback": "error"})
    t0 = time.perf_counter()
    with kernel_header_window():  # its C++ work on the core the capture leaves idle
        functions = [_capture(target, identity, i, args, kwargs, be, dynamic)
                     for i, (args, kwargs) in enumerate(inputs)]
    graphs = [dyn.compiled_backend(fn).key for fn in functions]
    modules = {module}.union(*(dyn.source_modules(fn) for fn in functions))
    try:
        code = module_sources(modules)
        blobs = {f"{ROLE_PREFIX}{i}": dyn.to_bytes(fn) for i, fn in enumerate(functions)}
    except Exception as e:  # noqa: BLE001 - pickling Dynamo's output fails in many ways; one error of ours
        raise PrecompileError(f"{identity}: Dynamo's output cannot be saved ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]})") from e
    factors = full_factors(probe.base, code, input_specs(inputs), dyn.global_state(), graphs,
                           [dyn.identities(fn) for fn in functions])
    key = compute_key(factors)
    metadata = {"probe": probe.key, "kind": KIND, "target": identity, "module": module, "graph_keys": graphs,
                "functions": len(functions), "bytes": sum(len(b) for b in blobs.values())}
    what = f"precompiled {identity}"
    served = tiered.get_or_build(Wanted.by_key(key, what), lambda: tiered.put(key, name, blobs, factors, metadata))
    if served.entry is not None and not served.pulled and not tiered.local.read_only:
        # stored here before (or by another process meanwhile): signed and pushed as a put would be
        tiered.sign(key)
        tiered.push(key, what)
    _log.info(f"aotc: precompiled {identity}: {len(functions)} function(s) traced and stored as "
              f"{key[:16]}… in {time.perf_counter() - t0:.2f}s")
    remember_fresh_values(dev, tiered.local.base / "toolchain")  # the warm start's lookup, without Inductor
    return Precompiled(target, identity, functions, key, traced_path(target, backend_kwargs, dynamic),
                       store=str(tiered.local.root))


def _check_signable(tiered: Any, identity: str) -> None:
    """Under a trust policy, what this process stores must be signed by a trusted key — else every
    later process would refuse it (and trace forever): refused before any work
    (:attr:`~aotc.fleet.tiered.TieredStore.can_sign`)."""
    if not tiered.can_sign:
        raise PrecompileError(f"{identity}: a trust policy is set (AOTC_TRUST_KEYS / trust=) and this process "
                              "has no trusted signing key: what it stored would be refused; set "
                              "AOTC_SIGNING_KEY to a trusted key, or precompile where it is signed and push it")


def _capture(target: Callable[..., Any], identity: str, i: int, args: tuple[Any, ...], kwargs: dict[str, Any],
             be: Any, dynamic: bool | None) -> Any:
    from aotc._torch.dynamo import dynamo_error, is_restart

    try:
        return dyn.capture(target, args, kwargs, be, dynamic)
    except AotcError as e:
        raise PrecompileError(f"{identity}: example_inputs[{i}]: {e}") from e
    except Exception as e:  # noqa: BLE001 - Dynamo's and the backend's errors, named in one line
        # a restart Dynamo still asked for after capture's retries: no trace is in progress here
        # to honour it, so it is a failure of this precompile like any other
        what = ("Dynamo asked to trace again too often" if is_restart(e) else
                "Dynamo cannot trace it whole" if isinstance(e, dynamo_error()) else type(e).__name__)
        raise PrecompileError(f"{identity}: example_inputs[{i}]: {what}: "
                              f"{' '.join(str(e).split())[:400]}") from e
