"""Dynamo capture: one trace of the model into an FX ``GraphModule`` plus the facts a loader needs
to feed that graph later without Dynamo.

How the token dim is made dynamic
---------------------------------
Every ``dynamic_dims[i]`` that is not ``None`` is marked with ``mark_unbacked`` and one shared
``shape_id``, so all token dims become the *same* unbacked symbol (``u0``). Why not
``mark_dynamic``: a backed symbol is specialized on 0/1 (Dynamo guards ``s0 >= 2``), so a call with
one token recompiles, and each marked input gets its own symbol (``s0``, ``s1``) tied by a guard.
An unbacked symbol has no 0/1 specialization, the graph stays valid for every size (1 included),
and its pieces compile with Inductor (``dynamic_shapes="from_graph"``) unchanged.

But model code that branches on the size (Hugging Face's mask / ``is_causal = q_len > 1``) fails
on an unbacked symbol with a data-dependent guard error; ``mode="auto"`` then traces again with
``mark_dynamic`` and records ``dynamic="backed"`` and ``token_range=(2, None)``: that graph is
only valid for sizes >= 2 (the choices Dynamo made for ``T >= 2`` are baked in): serving size 1
needs a static compile of size 1 checked numerically against eager, or a separate capture.
A torch without ``mark_unbacked(..., shape_id=)`` always gets the backed path.

Parameters as graph inputs
--------------------------
Dynamo's ``inline_inbuilt_nn_modules=True`` (the default since torch 2.5, patched on
here to be explicit) makes Dynamo lift every parameter and buffer to a graph placeholder instead
of baking it in as a constant. Dynamo hands the backend the *real* parameter objects as example
inputs, so each placeholder is mapped back to its FQN by object identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx

from aotc._torch import dynamo, layer_calls
from aotc.counters import COUNTERS
from aotc.errors import CaptureError
from aotc.gc_pause import gc_paused
from aotc.lookup.filehash import is_toolchain_file
from aotc.model.state import named_tensors

__all__ = ["ArgSlot", "Captured", "capture", "graph_args"]

_SHAPE_ID = "aotc_tokens"
_LAYER_CALLS = os.path.realpath(layer_calls.__file__)
ArgKind = Literal["param", "buffer", "input", "symbol"]


@dataclasses.dataclass(frozen=True)
class ArgSlot:
    """What one graph placeholder is fed with.

    - ``param`` / ``buffer``: ``fqn`` is the module attribute path (``layers.0.q_proj.weight``).
    - ``input``: ``index`` is the position in the user's ``example_inputs``.
    - ``symbol``: a size symbol; ``index`` is the user input it is read from and ``source`` says
      where, as ``"input <i> dim <d>"``.
    """

    kind: ArgKind
    fqn: str | None = None
    index: int | None = None
    source: str | None = None

    @property
    def dim(self) -> int | None:
        """For a ``symbol`` slot, the dim of input ``index`` whose size it is."""
        if self.kind != "symbol" or not self.source:
            return None
        return int(self.source.rsplit(" ", 1)[1])


@dataclasses.dataclass(frozen=True)
class Captured:
    """The result of :func:`capture`.

    ``gm``: the Dynamo graph (placeholder metas hold fake values with symbolic token sizes);
    ``example_inputs``: what the backend got (real params/inputs, ``SymInt`` for unbacked sizes);
    ``arg_spec``: one :class:`ArgSlot` per placeholder, in order; ``source_files``: sorted
    ``(path relative to package root, sha256)`` of every non-torch, non-stdlib file traced;
    ``dynamic``: how the token dim was made dynamic (``backed`` graphs are guarded for the sizes in
    ``token_range`` only, typically ``(2, None)``: size 1 needs its own static compile);
    ``token_range``: ``(min, max or None)`` the shape env proved for the token size.
    """

    gm: torch.fx.GraphModule
    example_inputs: tuple[Any, ...]
    arg_spec: tuple[ArgSlot, ...]
    source_files: tuple[tuple[str, str], ...]
    dynamic: Literal["unbacked", "backed", "static"] = "unbacked"
    token_range: tuple[int, int | None] | None = None


class _ModuleFiles(dict[str, str]):
    """Each loaded module's file -> its dotted module name: by the file name as loaded (what a
    code object's ``co_filename`` holds), and by realpath only when asked for a name it lacks
    (resolving every module's path costs ~50 ms: thousands of modules)."""

    def __init__(self) -> None:
        super().__init__()
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if isinstance(f, str) and f.endswith(".py"):
                self.setdefault(f, name)
        self._real: dict[str, str] | None = None

    def find(self, path: str) -> str | None:
        """The module loaded from ``path`` (as loaded, or by realpath)."""
        if path in self:
            return str(self[path])
        if self._real is None:
            self._real = {}
            for f, name in list(self.items()):
                self._real.setdefault(os.path.realpath(f), name)
        return self._real.get(os.path.realpath(path))


def _module_files() -> _ModuleFiles:
    """The loaded modules by file (:class:`_ModuleFiles`)."""
    return _ModuleFiles()


def _rel_source_path(path: str, modules: _ModuleFiles) -> str:
    """``path`` relative to its package root (``aotc/models/toy_llama.py``).

    Derived from the dotted name of the module loaded from that file (so editable installs and
    ``package-dir`` mappings give the logical path); otherwise relative to the longest
    ``sys.path`` entry that contains it; otherwise the bare file name.
    """
    real = os.path.realpath(path)
    name = modules.find(path)
    if name:
        parts = name.split(".")
        if os.path.basename(real) == "__init__.py":
            parts.append("__init__")
        else:
            parts[-1] = os.path.splitext(os.path.basename(real))[0]
        if name != "__main__":
            return "/".join(parts) + ".py"
    best = ""
    for entry in sys.path:
        root = os.path.realpath(entry or os.getcwd())
        if real.startswith(root.rstrip(os.sep) + os.sep) and len(root) > len(best):
            best = root
    rel = os.path.relpath(real, best) if best else os.path.basename(real)
    return rel.replace(os.sep, "/")


def _source_files(codes: Sequence[Any]) -> tuple[tuple[str, str], ...]:
    seen: dict[str, str] = {}
    modules: _ModuleFiles | None = None
    for code in codes:
        fname = getattr(code, "co_filename", None)
        if not fname or fname.startswith("<") or not os.path.isfile(fname):
            continue
        if is_toolchain_file(fname) or os.path.realpath(fname) == _LAYER_CALLS:
            continue  # (aotc's own wrapper of a layer: in the compile_logic factor)
        modules = modules if modules is not None else _module_files()
        rel = _rel_source_path(fname, modules)
        if rel not in seen:
            with open(fname, "rb") as f:
                seen[rel] = hashlib.sha256(f.read()).hexdigest()
    return tuple(sorted(seen.items()))


def _arg_spec(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    model: torch.nn.Module,
    user_inputs: Sequence[torch.Tensor],
) -> tuple[ArgSlot, ...]:
    by_id: dict[int, ArgSlot] = {}
    for fqn, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), ArgSlot("buffer", fqn=fqn))
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ArgSlot("param", fqn=fqn))
    for i, t in enumerate(user_inputs):
        by_id[id(t)] = ArgSlot("input", index=i)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise CaptureError(
            f"Dynamo graph has {len(placeholders)} placeholders but the backend got "
            f"{len(example_inputs)} example inputs; cannot map graph inputs"
        )
    # Where each symbol can be read: the first user input dim whose size is that symbol.
    sym_source: dict[Any, tuple[int, int]] = {}
    for node, ex in zip(placeholders, example_inputs):
        slot = by_id.get(id(ex))
        if slot is not None and slot.kind == "input" and slot.index is not None:
            fake = node.meta.get("example_value")
            for d, size in enumerate(getattr(fake, "shape", ())):
                if isinstance(size, torch.SymInt):
                    sym_source.setdefault(dynamo.symbol_key(size), (slot.index, d))

    spec: list[ArgSlot] = []
    for node, ex in zip(placeholders, example_inputs):
        slot = by_id.get(id(ex))
        if slot is None:
            val = node.meta.get("example_value", ex)
            if isinstance(val, torch.SymInt):
                where = sym_source.get(dynamo.symbol_key(val))
                if where is None:
                    raise CaptureError(
                        f"graph input {node.target!r} is size symbol {val} that is not the size "
                        "of any dim of a user input; only plain input dims can be dynamic"
                    )
                slot = ArgSlot("symbol", index=where[0], source=f"input {where[0]} dim {where[1]}")
            else:
                raise CaptureError(
                    f"graph input {node.target!r} ({type(ex).__name__}) is neither a parameter, "
                    "a buffer, a user input nor a size symbol; register tensors the model reads "
                    "as buffers (module.register_buffer) so they can be bound by name"
                )
        spec.append(slot)
    return tuple(spec)


DynamicMode = Literal["auto", "unbacked", "backed"]


def _trace(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    dynamic_dims: Sequence[int | None],
    unbacked: bool,
) -> tuple[dict[str, Any], list[Any]]:
    # Fresh tensor objects (same storage) so marks do not leak onto the caller's tensors.
    inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in example_inputs]
    for i, (t, d) in enumerate(zip(inputs, dynamic_dims)):
        if d is None:
            continue
        if not isinstance(t, torch.Tensor) or not -t.dim() <= d < t.dim():
            raise CaptureError(f"dynamic_dims[{i}]={d} is not a dim of input {i}")
        dynamo.mark(t, d % t.dim(), unbacked, _SHAPE_ID)

    got: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, ex: list[Any]) -> Any:
        if "gm" in got:
            raise CaptureError("Dynamo produced more than one graph (recompile); expected one")
        got.update(gm=gm, ex=list(ex), codes=dynamo.traced_code())
        return gm.forward

    with gc_paused():
        dynamo.trace_fullgraph(model, inputs, backend)
    if "gm" not in got:
        raise CaptureError("Dynamo captured no graph (was the model call skipped?)")
    return got, inputs


def _is_data_dependent(e: BaseException) -> bool:
    while e is not None:
        if "data-dependent" in str(e) or type(e).__name__ == "GuardOnDataDependentSymNode":
            return True
        e = e.__cause__  # type: ignore[assignment]  # walking the cause chain
    return False


def _token_range(gm: torch.fx.GraphModule) -> tuple[int, int | None] | None:
    """The value range the shape env proved for the (first) token size symbol."""
    for node in gm.graph.nodes:
        val = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(val, torch.SymInt):
            return dynamo.symbol_range(val)
    return None


def capture(
    model: torch.nn.Module,
    example_inputs: list[torch.Tensor],
    dynamic_dims: list[int | None],
    *,
    mode: DynamicMode = "auto",
    params_of: torch.nn.Module | None = None,
) -> Captured:
    """Trace ``model(*example_inputs)`` once with Dynamo (``fullgraph=True``) into one FX graph.

    ``dynamic_dims[i]`` is the token dim of input ``i`` (or ``None`` for static); all token dims
    share one size symbol. ``mode="auto"`` tries an unbacked symbol (valid for every size, 1
    included) and, when the model branches on the size (a data-dependent guard, e.g. Hugging
    Face masking code), traces again with ``mark_dynamic``; ``Captured.dynamic`` and
    ``Captured.token_range`` say which one and for which sizes the graph is valid. Runs under
    ``torch.no_grad()`` between two Dynamo resets, so it can be called
    repeatedly in one process. A graph break raises :class:`CaptureError` naming the file and
    line Dynamo reports. ``params_of``: the module whose parameter / buffer names the ArgSpec
    uses (default ``model``; a wrapper passes the user's module it wraps, so the names are the
    ones the user's own model has).
    """
    if len(dynamic_dims) != len(example_inputs):
        raise CaptureError(
            f"dynamic_dims has {len(dynamic_dims)} entries but there are "
            f"{len(example_inputs)} example inputs; give one (int or None) per input"
        )
    if mode not in ("auto", "unbacked", "backed"):
        raise CaptureError(f"mode={mode!r}: expected 'auto', 'unbacked' or 'backed'")
    has_dynamic = any(d is not None for d in dynamic_dims)
    unbacked = has_dynamic and mode != "backed" and dynamo.supports_shape_id()
    if mode == "unbacked" and has_dynamic and not unbacked:
        raise CaptureError(
            f"torch {torch.__version__} lacks mark_unbacked(shape_id=); use mode='backed'"
        )
    try:
        try:
            got, inputs = _trace(model, example_inputs, dynamic_dims, unbacked)
        except dynamo.dynamo_error() as e:
            if not (unbacked and mode == "auto" and _is_data_dependent(e)):
                raise
            unbacked = False
            got, inputs = _trace(model, example_inputs, dynamic_dims, unbacked)
    except CaptureError:
        raise
    except dynamo.dynamo_error() as e:  # graph break, unsupported op, ...
        raise CaptureError(_describe_dynamo_error(e)) from e
    except Exception as e:  # noqa: BLE001 - the model's own code failed while being traced
        raise CaptureError(_describe_model_error(e)) from e

    gm = got["gm"]
    COUNTERS.traces += 1
    return Captured(
        gm=gm,
        example_inputs=tuple(got["ex"]),
        arg_spec=_arg_spec(gm, got["ex"], model if params_of is None else params_of, inputs),
        source_files=_source_files(got["codes"]),
        dynamic=("unbacked" if unbacked else "backed") if has_dynamic else "static",
        token_range=_token_range(gm) if has_dynamic else None,
    )


def _users(filename: str) -> bool:
    """Whether a frame's file is the user's code (not torch's, a library's or aotc's own)."""
    return not is_toolchain_file(filename) and "/aotc/" not in filename.replace(os.sep, "/")


def _describe_model_error(e: BaseException) -> str:
    """The user frame where the model's forward raised, in one line."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if _users(f.filename)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    text = " ".join(str(e).split())[:300]
    return (f"{where}the model raised {type(e).__name__} while being traced on generated example "
            f"inputs: {text}; check the manifest's inputs (dtype, shape, high) against the model")


def _describe_dynamo_error(e: BaseException) -> str:
    """Dynamo's graph break in one line: what broke (for a nested compile region's, torch's
    wrapper error, the break inside it), torch's explanation, and the user frame it was in."""
    msg = [line.strip() for line in str(e).strip().splitlines()]
    head = getattr(e, "gb_type", None) or (msg[0] if msg else type(e).__name__)
    if msg and msg[0].endswith("Got graph break/error:"):  # a region's trace: what broke inside it
        inner = next((line for line in msg[1:] if line), "")
        head = f"inside a nested compile region: {inner}" if inner else head
    why = next((line[len("Explanation:"):].strip() for line in msg if line.startswith("Explanation:")), "")
    why = why.split(" Found in <", 1)[0]  # (torch names the operator object there)
    if why and why not in head:
        head = f"{head} ({why[:200]})"
    where = ""
    stack = [fr for fr in getattr(e, "real_stack", None) or () if _users(fr.filename)]
    if stack:
        fr = stack[-1]
        where = f"{fr.filename}:{fr.lineno}: "
        if fr.line:
            head = f"{head} (`{fr.line.strip()}`)"
    return (
        f"{where}graph break while capturing with fullgraph=True: {head}. "
        "Make that code traceable by Dynamo (or move it out of forward)"
    )


def graph_args(
    arg_spec: Sequence[ArgSlot], model: torch.nn.Module, inputs: Sequence[torch.Tensor]
) -> list[Any]:
    """Build the captured graph's positional arguments from a live module and user inputs."""
    state = named_tensors(model)
    args: list[Any] = []
    for slot in arg_spec:
        if slot.kind in ("param", "buffer"):
            args.append(state[slot.fqn])  # type: ignore[index]  # a slot of this kind always has fqn / index / dim
        elif slot.kind == "input":
            args.append(inputs[slot.index])  # type: ignore[index]  # a slot of this kind always has fqn / index / dim
        else:
            args.append(int(inputs[slot.index].shape[slot.dim]))  # type: ignore[index]  # a slot of this kind always has fqn / index / dim
    return args
