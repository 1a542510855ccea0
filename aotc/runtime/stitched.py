"""What both runtimes of a stored program share (:class:`StitchedProgram`): the stitching graph,
the table of its pieces — each compiled piece dispatched by the token count of the call in
flight (that size's static artifact, else the dynamic one) and given its inputs in the layout it
was compiled for; each splitting piece (attention) run eagerly — and a kernel's failure named by
piece and size. :class:`~aotc.runtime.runner.Runner` feeds it from a live module and the
manifest's inputs, :class:`~aotc.runtime.graphcall.GraphRunner` from a Dynamo graph's own
arguments.

Wrappers compose, in the shape of vLLM's ``CUDAGraphWrapper``: a program is built with
``wrap_piece`` / ``wrap_splitting`` (``wrap(name, call) -> call``), each applied once to every
compiled / splitting piece as the piece table is built (a CUDA graph set captures and replays
compiled pieces; the compile-time check zeroes an attention op's output buffer). Nothing is
swapped on a built program: another wrapping is another program over the same artifacts. With
no wrapper the table holds the plain callables, so a call pays nothing for the seam."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aotc.errors import AotcError, InputError, RunError
from aotc.records.graphcode import Bound, StraightLine, decoded, straight_line
from aotc.records.program import Program

__all__ = ["Artifact", "PieceCall", "PieceWrap", "SplittingCall", "StitchedProgram", "Timings",
           "in_layouts", "kernel_text"]

Artifact = Callable[..., Sequence[torch.Tensor]]
# ``wrap(piece name, its callable) -> the callable the stitch calls in its place``
PieceWrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
_PATH = re.compile(r"(?:/[^\s:,'\"]+)+\.(?:cpp|h|py|so)(?::\d+)?")  # compile-time staging paths


class PieceCall:
    """Calls a compiled piece's artifact for the runner's current token count (a runner is a
    :class:`StitchedProgram`: its thread-local ``_local.tokens`` and ``kernel_error``)."""

    def __init__(self, runner: Any, name: str, uid: str, by_size: Mapping[int | None, Artifact],
                 returns_tuple: bool = True, layouts: Sequence[Sequence[int] | None] | None = None) -> None:
        self.runner, self.name, self.uid, self.by_size = runner, name, uid, dict(by_size)
        self.returns_tuple = returns_tuple
        self.dynamic = self.by_size.get(None)
        self.layouts = [(i, tuple(o)) for i, o in enumerate(layouts or ()) if o is not None]
        self._strides: dict[Any, tuple[int, ...]] = {}
        self._local = runner._local  # the token count in flight, read per call

    def __call__(self, *args: Any) -> Sequence[torch.Tensor]:
        if self.layouts:
            args = in_layouts(args, self.layouts, self._strides)  # type: ignore[assignment]  # in_layouts hands back a sequence of the same arguments
        n = getattr(self._local, "tokens", 0)
        fn = self.by_size.get(n) or self.dynamic
        if fn is None:
            raise InputError(f"no artifact of piece {self.uid} serves {n} tokens "
                             f"(static sizes: {sorted(k for k in self.by_size if k)})")
        try:
            out = fn(*args)
        except RuntimeError as e:  # a kernel's own check (an index out of range, ...)
            if type(e) is not RuntimeError:  # out of memory and the like: the caller's to handle
                raise
            raise self.runner.kernel_error(self, n, e) from e
        out = out if isinstance(out, (list, tuple)) else (out,)
        return out if self.returns_tuple else out[0]


_ROW_MAJOR = {n: tuple(range(n)) for n in range(9)}


def in_layouts(args: Sequence[Any], layouts: Sequence[tuple[int, tuple[int, ...]]],
               memo: dict[Any, tuple[int, ...]]) -> Sequence[Any]:
    """``args`` with each tensor whose layout differs from the one its piece was compiled for
    (``layouts``: ``(position, dims outermost first)``) replaced by a copy in that layout; a dim
    of size 1 may have any stride. Inductor asserts its inputs' strides: another piece or an
    eager attention op may lay out its output otherwise than the trace said. ``memo``: the
    strides wanted per (position, shape), filled as calls come. A contiguous tensor wanted
    outermost-first (most are) is passed with one check, no stride arithmetic."""
    out: list[Any] | None = None
    for i, order in layouts:
        t = args[i] if i < len(args) else None
        if not isinstance(t, torch.Tensor) or t.dim() != len(order):
            continue
        if order == _ROW_MAJOR.get(len(order)) and t.is_contiguous() and t.numel():
            continue  # torch's contiguity ignores size-1 dims' strides, as the rule above does
        shape = t.shape
        want = memo.get((i, shape))
        if want is None:
            strides = [0] * len(order)
            step = 1
            for d in reversed(order):
                strides[d] = step
                step *= max(int(shape[d]), 1)
            want = memo[(i, shape)] = tuple(strides)
            if len(memo) > 256:  # a bounded memo: sizes come and go
                memo.clear()
        have = t.stride()
        if have != want and any(shape[d] != 1 and have[d] != want[d] for d in range(len(order))):
            out = list(args) if out is None else out
            out[i] = torch.empty_strided(shape, want, dtype=t.dtype, device=t.device).copy_(t)
    return args if out is None else tuple(out)


class SplittingCall:
    """Runs an attention piece's small graph eagerly."""

    def __init__(self, encoded: dict[str, Any]) -> None:
        self.graph, line = decoded(encoded)  # decoded once per graph shape (records.graphcode)
        self.direct: Callable[..., Any] = self if line is None else line.fn  # the graph as one function

    def __call__(self, *args: Any) -> Any:
        return self.graph({}, *args)


@dataclass
class Timings:
    """Seconds spent in each phase of a warm start (filled by the loader)."""

    phases: dict[str, float] = field(default_factory=dict)
    pulled_bytes: int = 0  # bytes fetched from a remote store on a local miss (pull-through)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def direct_stitch(program: Program, artifacts: Mapping[str, Mapping[int | None, Artifact]],
                  table: Mapping[str, Callable[..., Any]], size: int | None) -> StraightLine | None:
    """The program's stitch for ``size`` tokens (None: the dynamic artifacts) as one function,
    each compiled piece bound to that size's artifact (else its dynamic one, as
    :class:`PieceCall` picks) and each splitting piece to its graph as one function. None when a
    piece has no artifact for the size or the writer cannot write the stitch."""
    bound: dict[str, Bound] = {}
    for p in program.pieces:
        call = table[p.name]
        if p.kind != "compiled":
            bound[p.name] = Bound(call.direct if isinstance(call, SplittingCall) else call)
            continue
        by_size = artifacts[str(p.uid)]
        fn = by_size.get(size) or by_size.get(None)
        if fn is None:
            return None
        layouts = call.layouts if isinstance(call, PieceCall) else []
        bound[p.name] = Bound(fn, first=not p.returns_tuple, prepare=in_layouts if layouts else None,
                              prepare_args=(layouts, {}) if layouts else ())
    return straight_line(program.stitch, bound)


def _failed_piece(e: BaseException, line: StraightLine) -> str | None:
    """The name of the compiled piece whose call in ``line`` raised ``e`` (None: another line)."""
    tb = e.__traceback__
    name = None
    while tb is not None:
        if tb.tb_frame.f_code is line.fn.__code__:
            name = line.lines.get(tb.tb_lineno)
        tb = tb.tb_next
    return name


def kernel_text(e: BaseException) -> str:
    """A kernel's error in one line, without the compile-time staging paths it names."""
    text = " ".join(_PATH.sub("", str(e)).split())
    return re.sub(r"^kernel,\s*(?::\d+)?,\s*", "", text)[:300]  # "kernel, <path>:44, why"


class StitchedProgram:
    """A program's stitch over its pieces (module doc). ``modules`` replaces compiled pieces by
    name (the compile-time reference runs the pieces' own graphs eagerly through the same
    stitch). ``wrap_piece`` / ``wrap_splitting``: applied to each compiled / splitting piece's
    callable as the table is built (module doc); ``artifacts`` is kept, so that a program with
    other wrappers can be built over the same artifacts."""

    graphs: Any = None  # no CUDA graphs (a GraphedRunner around a Runner has them)

    def __init__(self, program: Program, artifacts: Mapping[str, Mapping[int | None, Artifact]],
                 key: str = "", timings: Timings | None = None,
                 modules: Mapping[str, Callable[..., Any]] | None = None,
                 wrap_piece: PieceWrap | None = None, wrap_splitting: PieceWrap | None = None) -> None:
        self.program, self.key, self.artifacts = program, key, artifacts
        self.timings = timings or Timings()
        self._local = threading.local()  # the token count of the call in flight, per thread
        self._stitch = decoded(program.stitch)[0]
        self._modules: dict[str, Callable[..., Any]] = {}
        for p in program.pieces:
            call: Callable[..., Any]
            if p.kind != "compiled":
                call = SplittingCall(p.graph or {"nodes": []})
                wrap = wrap_splitting
            else:
                call = modules[p.name] if modules is not None and p.name in modules else \
                    PieceCall(self, p.name, str(p.uid), artifacts[str(p.uid)], p.returns_tuple,
                              p.layouts)
                wrap = wrap_piece
            self._modules[p.name] = call if wrap is None else wrap(p.name, call)
        # with nothing wrapped or replaced: one straight-line stitch per size, written at its
        # first call, calling that size's artifacts directly (no PieceCall, no dispatch per
        # piece); the table above runs a size it cannot serve (and names the missing artifact)
        self._plain = modules is None and wrap_piece is None and wrap_splitting is None
        self._static = frozenset(s for p in program.pieces if p.kind == "compiled"
                                 for s in artifacts.get(str(p.uid), ()) if s is not None)
        self._lines: dict[int | None, StraightLine | None] = {}

    @property
    def current_tokens(self) -> int:
        """The token count of the call in flight on this thread (0: the dynamic artifacts)."""
        return int(getattr(self._local, "tokens", 0))

    def kernel_error(self, piece: PieceCall, n: int, e: BaseException) -> AotcError:
        """A compiled kernel's failure, named by piece and size."""
        what = f"{n} tokens" if n else "dynamic"
        return RunError(f"piece {piece.name} (unique piece {piece.uid[:8]}, {what}) failed: "
                        f"{kernel_text(e)}")

    def run_stitch(self, tokens: int, args: Sequence[Any]) -> Any:
        """The stitch over ``args`` (its placeholders' values), pieces dispatched for ``tokens``."""
        self._local.tokens = tokens
        size = tokens if tokens in self._static else None
        try:
            line = self._lines[size]
        except KeyError:
            line = self._lines[size] = direct_stitch(self.program, self.artifacts, self._modules,
                                                     size) if self._plain else None
        if line is None:
            if self.program.training:  # autograd through the pieces, as the caller's grad mode says
                return self._stitch(self._modules, *args)
            with torch.no_grad():
                return self._stitch(self._modules, *args)
        try:  # (both runtimes build ``args`` from the program's slots: one per placeholder)
            if self.program.training or not torch.is_grad_enabled():
                return line.fn(*args)
            with torch.no_grad():
                return line.fn(*args)
        except RuntimeError as e:  # a kernel's own check (an index out of range, ...)
            call = self._modules.get(_failed_piece(e, line) or "")
            if type(e) is not RuntimeError or not isinstance(call, PieceCall):  # out of memory and
                raise  # the like, or not a compiled piece's (attention's): the caller's to handle
            raise self.kernel_error(call, tokens, e) from e
