"""What aotc needs of Dynamo's private side (``torch._dynamo``, ``torch._guards``, SymNode
internals): marking a dim dynamic, one fullgraph trace handing the graph to a backend, the code
objects a trace inlined, Dynamo's exception type, and what a size symbol is and which range the
shape env proved for it. Tested on torch 2.11–2.13; ``mark_unbacked(shape_id=)`` is
feature-checked (absent before 2.12)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

__all__ = ["around_compiles", "dynamo_error", "free_symbol_range", "is_plain_symbol", "is_restart", "mark",
           "outside_trace", "serializable_callable_base", "supports_shape_id", "symbol_key", "symbol_range",
           "symint_hint", "trace_fullgraph", "traced_code"]


def _dynamo() -> Any:
    import torch._dynamo

    return torch._dynamo


def dynamo_error() -> type[BaseException]:
    """Dynamo's own exception base (graph breaks, unsupported ops): ``except dynamo_error()``."""
    return _dynamo().exc.TorchDynamoException


def is_restart(e: BaseException) -> bool:
    """Whether ``e`` is Dynamo's ``RestartAnalysis`` (its signal to trace again, raised through a
    backend): never caught, never a fallback."""
    try:
        from torch._dynamo.exc import RestartAnalysis
    except ImportError:
        return False
    return isinstance(e, RestartAnalysis)


def supports_shape_id() -> bool:
    """Whether ``mark_unbacked`` takes ``shape_id`` (every marked dim one shared symbol)."""
    try:
        from torch._dynamo.decorators import mark_unbacked
    except ImportError:
        return False
    return "shape_id" in inspect.signature(mark_unbacked).parameters


def mark(t: torch.Tensor, dim: int, unbacked: bool, shape_id: str) -> None:
    """Mark ``t``'s ``dim`` dynamic: an unbacked symbol shared by ``shape_id``, or a backed one."""
    from torch._dynamo import decorators

    if unbacked:
        decorators.mark_unbacked(t, dim, shape_id=shape_id)
    else:
        decorators.mark_dynamic(t, dim)


def traced_code() -> list[Any]:
    """The code objects the trace in progress inlined (call from inside a backend)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is None:
        return []
    if hasattr(ctx, "get_traced_code"):
        return list(ctx.get_traced_code() or [])
    return list(getattr(ctx, "traced_code", None) or [])


def trace_fullgraph(model: torch.nn.Module, inputs: Sequence[Any],
                    backend: Callable[[torch.fx.GraphModule, list[Any]], Any]) -> None:
    """``torch.compile(model, backend, fullgraph=True)(*inputs)`` once, under ``no_grad``, between
    two ``torch._dynamo.reset()``, parameters and buffers lifted to graph inputs."""
    dynamo = _dynamo()
    dynamo.reset()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # Deprecated (always True) on torch >= 2.12; patched for older torch.
            warnings.filterwarnings("ignore", message=".*inline_inbuilt_nn_modules.*")
            stack = contextlib.ExitStack()
            if hasattr(dynamo.config, "inline_inbuilt_nn_modules"):
                stack.enter_context(dynamo.config.patch(inline_inbuilt_nn_modules=True))
            with stack:
                compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
                compiled(*inputs)
    finally:
        dynamo.reset()


def symbol_key(size: torch.SymInt | torch.SymFloat | torch.SymBool) -> Any:
    """A hashable identity of a size symbol's expression (equal symbols, equal keys)."""
    return size.node.expr


def is_plain_symbol(size: Any) -> bool:
    """Whether ``size`` is a ``SymInt`` whose expression is one bare symbol (``s0``), not an
    expression of symbols (``2*s0``) or a constant."""
    return isinstance(size, torch.SymInt) and hasattr(size.node.expr, "name")


def free_symbol_range(size: torch.SymInt, symbol: Any) -> tuple[str, str] | None:
    """The range the shape env proved for ``symbol`` (one of :func:`symbol_key`'s free symbols),
    as ``(lower, upper)`` strings, or None when it has none."""
    vr = size.node.shape_env.var_to_range.get(symbol)
    return None if vr is None else (str(vr.lower), str(vr.upper))


def _as_int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def symbol_range(size: torch.SymInt) -> tuple[int, int | None] | None:
    """``(lower, upper or None)`` the shape env proved for a plain size symbol."""
    expr, env = size.node.expr, size.node.shape_env
    vr = env.var_to_range.get(expr) if hasattr(expr, "name") else None
    if vr is None:
        return None
    return _as_int(vr.lower) or 0, _as_int(vr.upper)


def serializable_callable_base() -> type:
    """torch's ``SerializableCallable`` (``torch._dynamo.aot_compile_types``, torch >= 2.10):
    what a backend must return for ``torch.compile(...).aot_compile`` and vLLM's AOT path to save
    its result; ``object`` on a torch without it."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:
        return object
    return SerializableCallable


@contextlib.contextmanager
def outside_trace() -> Any:
    """Run the block as if no Dynamo trace were in progress (a backend's own compiles and eager
    runs must not pick up the tracing context's fake mode)."""
    from torch._guards import tracing

    with tracing(None):
        yield


def symint_hint(size: Any) -> int | None:
    """The concrete value a backed size symbol had when traced (its hint), or None."""
    if not isinstance(size, torch.SymInt):
        return _as_int(size)
    node = size.node
    hint = getattr(node, "hint", None)
    if hint is not None:
        return _as_int(hint)
    env = node.shape_env
    try:  # torch >= 2.13 deprecates size_hint (a FutureWarning) for guarding_hint_or_throw
        if hasattr(env, "guarding_hint_or_throw"):
            return _as_int(env.guarding_hint_or_throw(node.expr))
        return _as_int(env.size_hint(node.expr))
    except Exception:  # noqa: BLE001 - unbacked: no hint
        return None


_around: dict[tuple[Callable[[], None], Callable[[], None]], tuple[Any, Any]] = {}  # by around_compiles


def around_compiles(start: Callable[[], None], end: Callable[[], None]) -> bool:
    """Call ``start`` when Dynamo starts compiling a frame and ``end`` when that compile ends
    (the backend called and returned, or the compile failed), in the compiling thread; nested
    compiles count once; what either raises is dropped (a compile never fails for them). One
    registration per pair, made again after ``torch._dynamo.reset()`` (which clears them): call
    it before each compile that wants it. torch 2.11–2.13: ``torch._dynamo.callback_handler``;
    False where torch has none."""
    handler = getattr(_dynamo(), "callback_handler", None)
    if handler is None or not hasattr(handler, "register_start_callback"):
        return False
    made = _around.get((start, end))
    if made is not None and made[0] in getattr(handler, "start_callbacks", ()):
        return True

    def call(fn: Callable[[], None]) -> Callable[[Any], None]:
        def callback(_args: Any) -> None:
            with contextlib.suppress(Exception):
                fn()
        return callback

    made = _around[(start, end)] = (call(start), call(end))
    handler.register_start_callback(made[0])
    handler.register_end_callback(made[1])
    return True
