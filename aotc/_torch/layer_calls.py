"""Layer calls Dynamo writes into the graph without tracing them (``torch.compiler.allow_in_graph``):
how a model's repeated layer is traced twice per kind and not at all after that.

In the block :func:`stamping` sets up, each kind of layer (instances aotc holds to be alike, by
:func:`aotc.compile.repeated.structure_key`) is called through one of three roles:

- ``PLAIN`` (a kind of one instance): its own forward, traced as ever;
- ``TRACED`` (the first two instances of a kind): the forward as a nested compile region
  (:mod:`aotc._torch.regions`: Dynamo traces the first and reuses that body for the second, or
  refuses to: side effects, other guards), its result handed through :func:`layer_exit` — a call
  of aotc's in the graph whose arguments are the layer's own (what each region operand was given
  as, for the stamp-out);
- ``CALLED`` (every later instance): one :func:`layer_call` node in the graph, nothing traced.
  Its fake value at trace time is a new tensor of each output's meta the kind's first traced call
  gave (``empty_strided`` under Dynamo's fake mode); run for real it is the layer's forward.

What replaces a ``layer_call`` node by the body it stands for — and proves it may — is
:mod:`aotc.compile.stamp`, after the trace. Only the trace sees the roles: they are undone after
the block (the classes' ``forward`` and the instances' ``_aotc_layer`` attribute).
Tested on torch 2.13 (2.11 has no region reuse: :func:`aotc._torch.regions.supported`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotc._torch import regions

__all__ = ["CALLED", "PLAIN", "TRACED", "Block", "Slot", "layer_call", "layer_exit", "stamping"]

PLAIN, TRACED, CALLED = 0, 1, 2
_ATTR = "_aotc_layer"


@dataclass
class Slot:
    """One layer instance in the block: its kind (index into the kinds given), its position in
    the kind and its role."""

    module: torch.nn.Module
    kind: int
    position: int
    role: int
    forward: Callable[..., Any] = field(repr=False, default=print)


@dataclass
class Block:
    """What :func:`stamping` set up: the slots, in the order of the kinds given, and why a
    ``layer_call`` could not be traced (``""``: it could), kept after the block for the report."""

    slots: list[Slot] = field(default_factory=list)
    refused: str = ""
    outputs: dict[int, Any] = field(default_factory=dict, repr=False)  # kind -> its first traced call's fake outputs
    ambient: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # slot -> the global state it was called in
    read: dict[int, frozenset[str] | None] = field(default_factory=dict)  # kind -> attribute names its body read
    # slot -> what the model had changed by its call (layer_calls._changed_state)
    changed: dict[int, tuple[tuple[str, Any], ...] | None] = field(default_factory=dict)


_BLOCK = Block()


def _is_fake(values: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(v, FakeTensor) for v in pytree.tree_leaves(values))


def ambient() -> tuple[Any, ...]:
    """The process-wide state a layer's ops depend on beyond its arguments: grad mode, inference
    mode, autocast (on and its dtype) for the CPU and CUDA. Dynamo sets it while it traces."""
    state: list[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for device in ("cpu", "cuda"):
        try:
            state += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
        except (RuntimeError, TypeError, AttributeError):  # (an older torch's signatures)
            state.append(None)
    return tuple(state)


def _attributes_read() -> frozenset[str] | None:
    """The names of the attributes the region bodies traced so far read (Dynamo's reuse records
    every source a body read: ``…layers._modules['0'].layer_idx``); None where this torch keeps
    them otherwise (then nothing is stamped out)."""
    from torch._guards import TracingContext

    try:
        cache = TracingContext.get().hop_dispatch_set_cache.get_cache(torch.ops.higher_order.invoke_subgraph)
        names = set()
        for entries in cache.subgraph_reuse_cache.values():  # type: ignore[union-attr]
            for condition, _ in entries:
                for source in condition.traced_sources or ():
                    tail = source.name.rsplit(".", 1)
                    if len(tail) == 2 and tail[1].isidentifier():
                        names.add(tail[1])
                    item = re.search(r"\['([A-Za-z_][A-Za-z0-9_]*)'\]$", source.name)  # vars(self)['layer_idx']
                    if item:
                        names.add(item.group(1))
        return frozenset(names)
    except Exception:  # noqa: BLE001 - torch's internals differ: read as "unknown"
        return None


def _readable(source: str) -> str:
    """A Dynamo source's name as a Python path (``L['self']._modules['layers']._modules['0'].scale``
    → ``self.layers.0.scale``; a global of another module, ``G['__import_m'].X`` → ``m.X``)."""
    source = re.sub(r"\._modules\['([^']+)'\]", r".\1", source)
    source = re.sub(r"^G\['__import_([^']+)'\]\.", r"\1.", source)
    return re.sub(r"^[GL]\['([^']+)'\]", r"\1", source)


def _changed_state() -> tuple[tuple[str, Any], ...] | None:
    """The state that existed before the trace and that the model has changed so far, as Dynamo
    has traced it (it records each change to replay after the graph): every attribute of a module
    or any object and every module-level global stored to, with the value it holds now (a constant
    by value, anything else by the traced value's identity), every outer list or dict changed,
    with its items; None where this torch keeps them otherwise. Equal at two layers' calls: the
    model changed nothing between them that a layer could read."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationExisting

        effects = InstructionTranslator.current_tx().output.side_effects
        out: list[tuple[str, Any]] = []
        for item, stored in effects.store_attr_mutations.items():
            if isinstance(item.mutation_type, AttributeMutationExisting) and item.source is not None:
                owner = "" if type(item.source).__name__ == "GlobalSource" else _readable(str(item.source.name)) + "."
                out += [(owner + name, _token(value)) for name, value in stored.items()]
        for var in effects.id_to_variable.values():
            if (var.source is not None and not effects.is_attribute_mutation(var)
                    and effects.is_modified(var)):
                items = getattr(var, "items", ())
                out.append((_readable(str(var.source.name)), tuple(id(v) for v in (
                    items.values() if isinstance(items, dict) else items))))
        return tuple(sorted(out, key=lambda kv: kv[0]))
    except Exception:  # noqa: BLE001 - torch's internals differ: read as "unknown"
        return None


def _token(value: Any) -> Any:
    try:
        if value.is_python_constant():
            return ("constant", repr(value.as_python_constant()))
    except Exception:  # noqa: BLE001 - not a constant after all
        pass
    return ("traced", id(value))


def layer_exit(slot: int, out: Any, *args: Any, **kwargs: Any) -> Any:
    """``out`` as given (a ``TRACED`` layer's result); the arguments its layer was called with
    ride along for the stamp-out. At trace time: the global state it was called in; for the
    kind's first call its fake outputs, for its second the attributes its body read; for each, the
    state the model had changed by then (:func:`_changed_state`)."""
    s = _BLOCK.slots[slot]
    if _is_fake(out):
        _BLOCK.ambient[slot], _BLOCK.changed[slot] = ambient(), _changed_state()
        if s.position == 0:
            _BLOCK.outputs[s.kind] = out
        elif s.position == 1:
            _BLOCK.read[s.kind] = _attributes_read()
    return out


def layer_call(slot: int, *args: Any, **kwargs: Any) -> Any:
    """A ``CALLED`` layer: its forward run for real; at trace time, fake outputs of the metas its
    kind's first traced call gave (a layer of the same structure given inputs of the same metas —
    which :mod:`aotc.compile.stamp` checks before it stamps the body out)."""
    s = _BLOCK.slots[slot]
    if not _is_fake((args, kwargs)):
        return s.forward(s.module, *args, **kwargs)
    _BLOCK.ambient[slot], _BLOCK.changed[slot] = ambient(), _changed_state()
    if s.kind not in _BLOCK.outputs:
        _BLOCK.refused = f"a {type(s.module).__name__} is called before its kind's first layer"
        raise RuntimeError(_BLOCK.refused)

    def fresh(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
        return o

    return pytree.tree_map(fresh, _BLOCK.outputs[s.kind])


_ALLOWED: list[bool] = []


def _allow_in_graph() -> None:
    """Register the two calls with Dynamo, once (not at import: that imports Dynamo)."""
    if not _ALLOWED:
        torch.compiler.allow_in_graph(layer_exit)
        torch.compiler.allow_in_graph(layer_call)
        _ALLOWED.append(True)


def _stamping_forward(region_fn: Any, fn: Any) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        slot, role = getattr(self, _ATTR)
        if role == CALLED:
            return layer_call(slot, *args, **kwargs)
        if role == TRACED:
            return layer_exit(slot, region_fn(self, *args, **kwargs), *args, **kwargs)
        return fn(self, *args, **kwargs)

    return forward


@contextlib.contextmanager
def stamping(kinds: Sequence[Sequence[torch.nn.Module]], traced: int = 2) -> Iterator[Block]:
    """The block (module doc): the first ``traced`` instances of each kind of two or more are
    traced as a region, the rest become ``layer_call`` nodes; yields the :class:`Block`. Not
    re-entrant (one trace at a time, as Dynamo's own)."""
    global _BLOCK
    if _BLOCK.slots:
        raise RuntimeError("a layer stamp-out is already in progress")
    _allow_in_graph()
    slots: list[Slot] = []
    for k, group in enumerate(kinds):
        for i, m in enumerate(group):
            role = PLAIN if len(group) < 2 else TRACED if i < traced else CALLED
            slots.append(Slot(m, k, i, role))
    try:
        with regions.marked(kinds, max_reuse=traced, wrap=_stamping_forward) as originals:
            for n, s in enumerate(slots):
                s.forward = originals[n]
                object.__setattr__(s.module, _ATTR, (n, s.role))
            block = _BLOCK = Block(slots)
            yield block
    finally:
        _BLOCK = Block()
        for s in slots:
            s.module.__dict__.pop(_ATTR, None)
