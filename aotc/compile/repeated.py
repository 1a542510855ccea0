"""A model's repeated layer traced once: which classes to trace as nested compile regions, the
capture with them, and the proof that every reuse Dynamo made was right.

Which classes: ``regions: auto`` (the manifest's default) takes every class of which one module
container (``nn.ModuleList`` / ``nn.Sequential``) holds two or more instances — a transformer's
decoder layers — except torch's own modules and classes whose instances all sit inside another
such class's (the outermost repeated block is the one worth reusing); a list of class names
picks them; ``off`` traces everything inline.

How: the first two layers of each kind are traced as a nested compile region — Dynamo traces the
first and reuses its body for the second (or refuses: side effects, other guards) — and every
later layer is not traced at all: Dynamo writes one opaque call of aotc's per layer
(:mod:`aotc._torch.layer_calls`), which :mod:`aotc.compile.stamp` then makes a region call of the
same body, given that layer's own weights and inputs (30 more layers of a toy Llama: +0.1 s of
capture instead of +0.65 s with Dynamo stamping each region call out itself, +1.6 s traced
plainly).

The proof, per region call in the graph (``aotc._torch.regions``): the weights it is
given are all of ONE instance of a marked class, no two calls get the same instance, each weight
sits where the body's first call has the same weight of its own instance (same relative name
at the same operand), and every instance sharing a body has the same structure key
(:func:`structure_key`: class, code, parameter and buffer layouts, attributes, hooks inside the
body — different weights, same code). A graph that fails any of it, or a trace that fails with
regions, is traced again without them (one line says why): a wrong reuse is never served.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
from collections.abc import Sequence
from typing import Any

import torch

from aotc._torch import layer_calls, regions
from aotc.compile.capture import Captured, capture
from aotc.compile.stamp import stamp_out
from aotc.errors import CaptureError
from aotc.gc_pause import gc_paused

__all__ = ["RegionReport", "capture_repeated", "repeated_classes", "structure_key"]

_PRIMITIVE = (bool, int, float, str, bytes, type(None))
# a module's bookkeeping in its __dict__: described on their own (tensors, children, hooks)
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                 "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks", "_is_full_backward_hook"}
_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called")


@dataclasses.dataclass(frozen=True)
class RegionReport:
    """What the capture did with regions: the classes marked, the region calls Dynamo made, the
    distinct bodies (one per kind of layer), and why regions were not used (``""``: used)."""

    classes: tuple[str, ...] = ()
    calls: int = 0
    bodies: int = 0
    stamped: int = 0
    fallback: str = ""

    def line(self) -> str:
        """One line for the progress stream."""
        if self.fallback:
            return f"traced every layer ({self.fallback})"
        if not self.classes:
            return "no repeated layer"
        return (f"{'/'.join(self.classes)}: {self.calls} layers traced as {self.bodies} "
                f"bod{'y' if self.bodies == 1 else 'ies'}"
                + (f", {self.stamped} of them stamped out unseen by Dynamo" if self.stamped else ""))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def repeated_classes(model: torch.nn.Module, wanted: Sequence[str] | str = "auto") -> list[type]:
    """The classes to trace as regions (module doc): ``"auto"``, ``"off"`` or class names (bare
    or qualified). A named class the model does not hold raises :class:`CaptureError`."""
    if wanted == "off":
        return []
    classes = {type(m) for m in model.modules()}
    if wanted != "auto":
        picked = []
        for name in wanted:
            found = [c for c in classes if name in (c.__name__, _qualname(c))]
            if not found:
                raise CaptureError(f"regions: the model has no module of class {name!r} "
                                   f"(its classes: {', '.join(sorted(c.__name__ for c in classes))[:300]})")
            picked += found
        return sorted(set(picked), key=_qualname)
    counted: dict[type, int] = {}
    for m in model.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            per: dict[type, int] = {}
            for child in m.children():
                per[type(child)] = per.get(type(child), 0) + 1
            for cls, n in per.items():
                if n >= 2 and not cls.__module__.startswith("torch.") and "forward" in dir(cls):
                    counted[cls] = counted.get(cls, 0) + n
    inner = {cls for cls in counted for outer in counted if outer is not cls
             and all(_inside(model, m, outer) for m in model.modules() if type(m) is cls)}
    return sorted((c for c in counted if c not in inner), key=_qualname)


def _inside(model: torch.nn.Module, module: torch.nn.Module, outer: type) -> bool:
    return any(type(o) is outer and any(s is module for s in o.modules()) and o is not module
               for o in model.modules())


_BY_VALUE_AT_MOST = 64  # a container or object compared by value holds at most this many items


def _value(v: Any, depth: int = 0, holder: Any = None) -> Any:
    """An attribute's value as the key holds it: primitives, dtypes, enums, functions (by code
    and closure), ``functools.partial``, small dicts with primitive keys (peft's per-adapter
    ``r``, ``scaling``), methods bound to ``holder`` (the module holding the attribute: torchao's
    per-instance ``extra_repr``) and small plain objects of a Python class (diffusers' attention
    processors: class and attributes) by value; anything else by identity (the same object, not
    an equal one)."""
    if isinstance(v, _PRIMITIVE):
        return v
    if isinstance(v, enum.Enum):
        return (type(v).__qualname__, v.name)
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if depth < 4:
        if isinstance(v, (tuple, list)) and len(v) <= _BY_VALUE_AT_MOST:
            return (type(v).__name__, tuple(_value(x, depth + 1) for x in v))
        if (type(v) is dict and len(v) <= _BY_VALUE_AT_MOST
                and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in v)):
            return ("dict", tuple(sorted(((type(k).__name__, k), _value(x, depth + 1)) for k, x in v.items())))
        if isinstance(v, functools.partial):
            return ("partial", _value(v.func, depth + 1), _value(v.args, depth + 1),
                    tuple(sorted((k, _value(x, depth + 1)) for k, x in v.keywords.items())))
        if isinstance(v, types.FunctionType):
            cells = tuple(_value(c.cell_contents, depth + 1) for c in v.__closure__ or ())
            return ("function", id(v.__code__), cells, _value(v.__defaults__, depth + 1))
        if isinstance(v, types.MethodType):
            bound = "holder" if holder is not None and v.__self__ is holder else ("object", id(v.__self__))
            return ("method", _value(v.__func__, depth + 1), bound)
        if _plain_object(v):
            return ("instance", _qualname(type(v)),
                    tuple(sorted((k, _value(x, depth + 1)) for k, x in vars(v).items())))
    return ("object", id(v))


def _plain_object(v: Any) -> bool:
    """An instance of a Python class (not a module, tensor or type) whose state is its few
    attributes: compared by class and attributes."""
    cls = type(v)
    return (not isinstance(v, (torch.nn.Module, torch.Tensor, type, types.ModuleType))
            and getattr(cls, "__module__", "builtins") not in ("builtins", "torch")
            and not cls.__module__.startswith("torch.")
            and "__slots__" not in vars(cls) and isinstance(getattr(v, "__dict__", None), dict)
            and len(vars(v)) <= _BY_VALUE_AT_MOST)


def _tensor(t: torch.Tensor) -> Any:
    return (type(t).__name__, str(t.dtype), tuple(t.shape), tuple(t.stride()), str(t.device),
            t.requires_grad)


def structure_key(module: torch.nn.Module, skip: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """``module``'s structure (module doc), the weights' values left out: every submodule's class
    and ``forward``, its parameters' and buffers' layouts, its attributes (``skip``: dotted
    attribute paths left out), and the hooks of its submodules (the module's own call hooks run
    outside its body)."""
    out: list[Any] = []
    for path, m in module.named_modules(remove_duplicate=False):
        out.append((path, _qualname(type(m)), _value(m.__dict__.get("forward", type(m).forward))))
        for name, t in (*m._parameters.items(), *m._buffers.items()):
            out.append((path, name, None if t is None else _tensor(t)))
        for name, v in sorted(m.__dict__.items()):
            where = f"{path}.{name}" if path else name
            if name in _MODULE_STATE or where in skip:
                continue
            if name in _CALL_HOOKS:
                if path:  # a submodule's hooks run inside the body
                    out.append((where, tuple(id(h) for h in v.values()) if hasattr(v, "values") else _value(v)))
                continue
            out.append((where, _value(v, holder=m)))
    return tuple(out)


def _index_attributes(instances: Sequence[torch.nn.Module]) -> frozenset[str]:
    """Attribute paths whose values differ only by the instance's position plus a constant: a
    layer's index (``layer_idx``), or a name or dict holding it (peft's per-layer
    ``kwargs["target_name"]``, ``"model.layers.3.self_attn.q_proj"``) — what a body that reads it
    has guarded on (Dynamo then traces that layer on its own); left out of the structure key."""
    if len(instances) < 2:
        return frozenset()
    values = [dict(_attributes(m)) for m in instances]
    common = set(values[0]).intersection(*values[1:])
    out = set()
    for p in common:
        vs = [v[p] for v in values]
        if type(vs[0]) is int and all(type(x) is int for x in vs):
            if len({x - i for i, x in enumerate(vs)}) == 1 and vs[0] != vs[1]:
                out.add(p)
        elif _by_index(vs):
            out.add(p)
    return frozenset(out)


def _by_index(vs: list[Any]) -> bool:
    """Whether strings (or small dicts, lists and tuples of them) differ only by a number that is
    each one's position plus the same constant."""
    first = _numbers(vs[0])
    for c in first:
        marked = [_marked(v, str(c + i)) for i, v in enumerate(vs)]
        if all(m == marked[0] for m in marked) and _value(vs[0]) != _value(vs[1]):
            return True
    return False


def _numbers(v: Any, depth: int = 0) -> set[int]:
    if isinstance(v, str):
        return {int(n) for n in re.findall(r"(?<![0-9])[0-9]{1,6}(?![0-9])", v)}
    if depth < 3 and isinstance(v, (dict, list, tuple)) and len(v) <= _BY_VALUE_AT_MOST:
        return set().union(*(_numbers(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)))
    return set()


def _marked(v: Any, number: str, depth: int = 0) -> Any:
    """``v`` as the structure key holds it (:func:`_value`), with ``number`` standing alone in its
    strings (in small dicts, lists and tuples too) replaced by a mark."""
    if isinstance(v, str):
        return re.sub(rf"(?<![0-9]){number}(?![0-9])", "#", v)
    if depth < 3 and type(v) is dict and len(v) <= _BY_VALUE_AT_MOST and all(isinstance(k, str) for k in v):
        return ("dict", tuple((k, _marked(x, number, depth + 1)) for k, x in sorted(v.items())))
    if depth < 3 and isinstance(v, (list, tuple)) and len(v) <= _BY_VALUE_AT_MOST:
        return (type(v).__name__, tuple(_marked(x, number, depth + 1) for x in v))
    return _value(v, depth)


def _attributes(module: torch.nn.Module) -> list[tuple[str, Any]]:
    out = []
    for path, m in module.named_modules(remove_duplicate=False):
        for name, v in m.__dict__.items():
            if name not in _MODULE_STATE and name not in _CALL_HOOKS:
                out.append((f"{path}.{name}" if path else name, v))
    return out


def _prove(captured: Captured, model: torch.nn.Module, classes: Sequence[type],
           key_of: dict[int, tuple[Any, ...]] | None = None) -> tuple[int, int]:
    """``(calls, bodies)`` of the captured graph's region calls, each reuse checked (module
    doc); raises :class:`CaptureError` naming the first that is not right. ``key_of``: each
    instance's structure key by ``id`` (as :func:`_kinds` made them; made here when absent)."""
    calls = regions.region_calls(captured.gm)
    if not calls:
        return 0, 0
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    fqn_of = {n: s.fqn for n, s in zip(placeholders, captured.arg_spec) if s.kind in ("param", "buffer")}
    wanted = set(classes)
    instances = {path: m for path, m in model.named_modules() if type(m) in wanted}
    if key_of is None:
        key_of = _kinds(model, classes)[1]
    keys: dict[str, tuple[Any, ...]] = {}
    first: dict[str, list[str | None]] = {}  # body -> relative weight name per operand
    used: set[str] = set()
    for call in calls:
        weights = [fqn_of.get(o) if isinstance(o, torch.fx.Node) else None for o in call.operands]
        owner = _owner([w for w in weights if w], instances)
        if owner is None:
            raise CaptureError(f"region call {call.node.name} is given weights of no single layer "
                               f"({', '.join(sorted({w for w in weights if w})[:4])})")
        if owner in used:
            raise CaptureError(f"region call {call.node.name} is given the weights of {owner!r}, "
                               "which an earlier call already used")
        used.add(owner)
        rel = [w[len(owner) + 1:] if w else None for w in weights]
        if first.setdefault(call.body, rel) != rel:
            raise CaptureError(f"region call {call.node.name} ({owner}) passes its weights in "
                               "another order than the body's first call")
        key = key_of[id(instances[owner])]
        if keys.setdefault(call.body, key) != key:
            raise CaptureError(f"layer {owner!r} reuses body {call.identifier!r} but differs in "
                               "structure from the layer it was traced for")
    return len(calls), len(first)


def _not_reusable(model: torch.nn.Module) -> str:
    """Why no region of ``model`` could be reused in this trace ("" when it could): a torch
    without reuse, or a model that builds a KV cache in its forward (transformers'
    ``config.use_cache``): the cache update in every layer is a side effect, which makes a
    layer's body ineligible (torch 2.13), and marking it only adds to the trace. Calling it
    with ``use_cache=False`` instead is not the same model: transformers then reads the
    position ids as packed sequences (another mask) — set ``use_cache: false`` in the config
    where that is the model meant. An encoder's ``use_cache`` (BERT and its kin: on by default)
    builds nothing: its model reads it only as a decoder (:func:`_builds_kv_cache`)."""
    if not regions.supported():
        return f"torch {torch.__version__} does not reuse a traced region (2.12+)"
    if _builds_kv_cache(model):
        return "the model builds a KV cache in its forward (config.use_cache): no layer is reusable"
    return ""


def _builds_kv_cache(model: torch.nn.Module) -> bool:
    """Whether a transformers model builds a KV cache in its forward: a config of its with
    ``use_cache`` on — unless that config says it is no decoder (``is_decoder`` off, not an
    encoder-decoder) and one of the modules it configures sets ``use_cache`` under
    ``if config.is_decoder:`` in its forward, as BERT's encoder does to turn the cache off. A
    forward whose source cannot be read counts as building one (the trace is then plain: slower,
    never wrong)."""
    by_config: dict[int, list[torch.nn.Module]] = {}
    configs: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", False) is True:
            by_config.setdefault(id(cfg), []).append(m)
            configs[id(cfg)] = cfg
    for key, modules in by_config.items():
        cfg = configs[key]
        encoder = getattr(cfg, "is_decoder", None) is False and not getattr(cfg, "is_encoder_decoder", False)
        if not (encoder and any(_reads_is_decoder(type(m).forward) for m in modules)):
            return True
    return False


@functools.lru_cache(maxsize=256)
def _reads_is_decoder(forward: Any) -> bool:
    """Whether ``forward``'s code (not its docstring: GPT-NeoX's example sets
    ``config.is_decoder``) sets ``use_cache`` under ``if ….config.is_decoder:``, as BERT's does."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False

    def is_decoder_test(test: ast.expr) -> bool:
        return isinstance(test, ast.Attribute) and test.attr == "is_decoder" and (
            isinstance(test.value, ast.Attribute) and test.value.attr == "config"
            or isinstance(test.value, ast.Name) and test.value.id == "config")

    def sets_use_cache(nodes: list[ast.stmt]) -> bool:
        return any(isinstance(t, ast.Name) and t.id == "use_cache"
                   for n in nodes for a in ast.walk(n) if isinstance(a, ast.Assign) for t in a.targets)

    return any(isinstance(n, ast.If) and is_decoder_test(n.test) and sets_use_cache([*n.body, *n.orelse])
               for n in ast.walk(tree))


def _kinds(model: torch.nn.Module, classes: Sequence[type]
           ) -> tuple[list[list[torch.nn.Module]], dict[int, tuple[Any, ...]], dict[int, frozenset[str]]]:
    """The instances of each class grouped by structure key (index attributes left out): one
    group per kind of layer, in order of first appearance; each instance's key by ``id``; and per
    group (by its place) the names, by their last component, of the index attributes its key
    left out — all its layers may differ in."""
    out: list[list[torch.nn.Module]] = []
    key_of: dict[int, tuple[Any, ...]] = {}
    left_out: dict[int, frozenset[str]] = {}
    for cls in classes:
        ms = [m for m in model.modules() if type(m) is cls]
        skip = _index_attributes(ms)
        groups: dict[tuple[Any, ...], list[torch.nn.Module]] = {}
        for m in ms:
            key_of[id(m)] = structure_key(m, skip)
            groups.setdefault(key_of[id(m)], []).append(m)
        for group in groups.values():
            left_out[len(out)] = frozenset(p.rsplit(".", 1)[-1] for p in skip)
            out.append(group)
    return out, key_of, left_out


def _each_at_one_place(model: torch.nn.Module, classes: Sequence[type]) -> None:
    """Raise where a layer instance is held at two places of the model (weights shared between
    layers: it is called twice, and a body cannot be both its own and another's)."""
    seen: dict[int, str] = {}
    wanted = set(classes)
    for path, m in model.named_modules(remove_duplicate=False):
        if type(m) in wanted:
            if id(m) in seen:
                raise CaptureError(f"layer {seen[id(m)]!r} is also at {path!r} (one layer called at two "
                                   "places): each layer traced")
            seen[id(m)] = path


def _owner(weights: Sequence[str], instances: dict[str, torch.nn.Module]) -> str | None:
    """The innermost marked instance holding every one of ``weights``, if any."""
    if not weights:
        return None
    holding = [p for p in instances if all(w.startswith(p + ".") for w in weights)]
    return max(holding, key=len, default=None)


def capture_repeated(model: torch.nn.Module, example_inputs: list[torch.Tensor],
                     dynamic_dims: list[int | None], *, params_of: torch.nn.Module | None = None,
                     wanted: Sequence[str] | str = "auto") -> tuple[Captured, RegionReport]:
    """:func:`aotc.compile.capture.capture` with the model's repeated layers traced once each
    (module doc), the graph flat (regions inlined) and every reuse proven; else a plain capture
    and the reason in the report."""
    owner = model if params_of is None else params_of
    classes = repeated_classes(owner, wanted)
    names = tuple(c.__name__ for c in classes)
    why = "" if not classes else _not_reusable(owner)
    if not classes or why:
        return capture(model, example_inputs, dynamic_dims, params_of=params_of), RegionReport(names, fallback=why)
    block = layer_calls.Block()
    try:
        _each_at_one_place(owner, classes)
        kinds, key_of, differing = _kinds(owner, classes)
        with layer_calls.stamping(kinds) as block:
            captured = capture(model, example_inputs, dynamic_dims, params_of=params_of)
        with gc_paused():
            if _kinds(owner, classes)[1] != key_of:  # (the trace ran the model: what it set shows)
                raise CaptureError("a layer's attributes changed while the model ran (set by its "
                                   "forward, a hook or the model between layers)")
            captured, stamped = stamp_out(captured, owner, block, differing)
            calls, bodies = _prove(captured, owner, classes, key_of)
            regions.inline_regions(captured.gm)
        return captured, RegionReport(names, calls, bodies, stamped)
    except Exception as e:  # noqa: BLE001 - anything short of a proven graph: a plain trace, and why
        reason = block.refused or f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
    return (capture(model, example_inputs, dynamic_dims, params_of=params_of),
            RegionReport(names, fallback=f"regions of {', '.join(names)} not used: {reason}"))
