"""CUDA Graphs for a loaded program: piecewise (each compiled piece one graph, attention eager
in between) or full (the whole forward one graph), one graph set per capture size, captured
largest first into one shared memory pool.

Replay of a call with ``n`` tokens uses the smallest capture size ``c >= n``: every input is
padded with zeros along its token dim to ``c``, the graphs run, and each output is cut back to
``n`` along ITS token dim and cloned (graph outputs live in the pool and are overwritten by the
next replay). An output's token dim need not be dim 0 (an HF model's batch-first logits
``[1, n, vocab]``): it is the dim that follows the token count, found before capture by running
the program without graphs at two sizes (so it holds for every stored program, whatever the
format recorded); an output with none cannot be cut back, and capture refuses it.
Padding is sound for models whose rows only depend on earlier rows (causal attention, the
token-wise rest of a transformer): the padded rows come last. Above the largest capture size a
call runs without graphs.

Static buffers (piecewise): a piece's tensor argument that is a bound weight or the output of a
graph captured earlier in the same forward has a fixed address and is used as is; any other
(the eager attention's output, the user's inputs) gets a static buffer that each replay copies
into. Each size's graphs are checked against the graph-less path on the capture inputs.

The graph object is behind :class:`CudaGraph` (``capture``/``replay``) so that the bookkeeping
can be exercised where there is no GPU (see tests); on CUDA it is ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aotc.errors import LoadError
from aotc.runtime.checking import flat_tensors, kept

if TYPE_CHECKING:
    from aotc.records.program import Program
    from aotc.runtime.runner import Runner
    from aotc.runtime.stitched import Timings

MODES = ("none", "piecewise", "full")


class CudaGraph:
    """One ``torch.cuda.CUDAGraph``: ``capture`` records ``fn(*args)`` into the shared pool and
    returns its (static) outputs; ``replay`` re-runs the recorded kernels."""

    def __init__(self, pool: Any) -> None:
        self.pool, self.graph = pool, torch.cuda.CUDAGraph()

    @staticmethod
    def new_pool() -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn(*args)
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class GraphReport:
    """What capturing cost: sizes captured, graphs, seconds, and pool memory (bytes reserved by
    the CUDA caching allocator over the capture; 0 where not measurable)."""

    mode: str
    sizes: list[int] = field(default_factory=list)
    graphs: int = 0
    seconds: float = 0.0
    pool_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "sizes": self.sizes, "graphs": self.graphs,
                "seconds": round(self.seconds, 4), "pool_bytes": self.pool_bytes}


@dataclass
class _Captured:
    graph: Any
    static_args: list[Any]
    outputs: Any


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


class _GraphedPiece:
    """One compiled piece of a graph set's runner: its callable, run plainly or captured /
    replayed for the capture size in flight (:meth:`GraphSet.piece`)."""

    __slots__ = ("graphs", "name", "call")

    def __init__(self, graphs: GraphSet, name: str, call: Callable[..., Any]) -> None:
        self.graphs, self.name, self.call = graphs, name, call

    def __call__(self, *args: Any) -> Any:
        return self.graphs.piece(self.name, self.call, args)


class GraphSet:
    """The captured graphs of one runner. Created by :func:`capture`; :class:`GraphedRunner`
    asks :meth:`serves` / :meth:`run` per call. Piecewise, it runs a runner of its own
    (:attr:`runner`: the given one's program, artifacts and model, each compiled piece wrapped
    by :meth:`wrap` as the piece table is built, as vLLM's ``CUDAGraphWrapper`` wraps a piece);
    the runner given is left as it is. Full, the given runner itself, run inside one graph."""

    def __init__(self, runner: Runner, mode: str, graph_cls: type[CudaGraph] = CudaGraph) -> None:
        if mode not in MODES or mode == "none":
            raise LoadError(f"cudagraph mode {mode!r}: expected piecewise or full")
        self.mode, self.graph_cls = mode, graph_cls
        self.pool = graph_cls.new_pool()
        self.sizes: list[int] = []
        self.report = GraphReport(mode)
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: ("capture" | "replay", size) while running
        self._pieces: dict[tuple[str, int], _Captured] = {}
        self._full: dict[int, tuple[_Captured, list[torch.Tensor]]] = {}
        self._stable: set[int] = {t.data_ptr() for t in runner.bound_tensors()}
        self.token_dims: list[int] = []  # per flat output (output_token_dims), set by capture()
        self.runner: Runner = runner.wrapped(wrap_piece=self.wrap) if mode == "piecewise" else runner

    # -- per call ---------------------------------------------------------------------------
    def serves(self, n: int) -> int | None:
        """The capture size a call with ``n`` tokens replays at, or None (run without graphs)."""
        return next((c for c in sorted(self.sizes) if c >= n), None)

    def run(self, inputs: Sequence[torch.Tensor], n: int, c: int) -> Any:
        """Pad to ``c``, replay, slice back to ``n`` rows (a copy)."""
        padded = self._pad(inputs, c)
        with self._lock:
            if self.mode == "full":
                captured, static_inputs = self._full[c]
                for s, x in zip(static_inputs, padded):
                    s.copy_(x)
                captured.graph.replay()
                out = captured.outputs
            else:
                self._local.state = ("replay", c)
                try:
                    out = self.runner.run_at(padded, c)
                finally:
                    self._local.state = None
            return _cut(out, n, self.token_dims)

    def wrap(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """Compiled piece ``name``'s callable in this set's runner (``wrap_piece``)."""
        return _GraphedPiece(self, name, call)

    def piece(self, name: str, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Run compiled piece ``name``: plainly, or capture / replay its graph for this size."""
        state = getattr(self._local, "state", None)
        if state is None:
            return fn(*args)
        kind, c = state
        if kind == "replay":
            cap = self._pieces.get((name, c))
            if cap is None:
                raise LoadError(f"no CUDA graph of piece {name} for {c} tokens")
            for s, a in zip(cap.static_args, args):
                if isinstance(s, torch.Tensor):
                    if s.data_ptr() != a.data_ptr():
                        s.copy_(a)
                elif s != a:
                    raise LoadError(f"piece {name}: argument {a!r} differs from the captured {s!r}")
            cap.graph.replay()
            return cap.outputs
        static_args = [a if not isinstance(a, torch.Tensor) or a.data_ptr() in self._stable
                       else a.clone() for a in args]
        graph = self.graph_cls(self.pool)
        out = graph.capture(fn, static_args)
        self._pieces[(name, c)] = _Captured(graph, static_args, out)
        self._stable.update(t.data_ptr() for t in _as_list(out) if isinstance(t, torch.Tensor))
        self.report.graphs += 1
        return out

    # -- capture ------------------------------------------------------------------------------
    def capture_size(self, c: int) -> None:
        """Warm up, capture and check the graphs for ``c`` tokens."""
        inputs = self.runner.dummy_inputs(c)
        want = _as_list(self.runner.run_at(inputs, c))  # warm-up (also: the reference)
        want = [w.clone() if isinstance(w, torch.Tensor) else w for w in want]
        if self.mode == "full":
            static_inputs = [x.clone() for x in inputs]
            graph = self.graph_cls(self.pool)
            out = graph.capture(lambda *xs: self.runner.run_at(list(xs), c), static_inputs)
            self._full[c] = (_Captured(graph, static_inputs, out), static_inputs)
            self.report.graphs += 1
        else:
            self._local.state = ("capture", c)
            try:
                self.runner.run_at(inputs, c)
            finally:
                self._local.state = None
        self.sizes.append(c)
        got = _as_list(self.run(inputs, c, c))
        for g, w in zip(got, want):
            if isinstance(w, torch.Tensor) and not torch.allclose(g, w, atol=1e-3, rtol=1e-3):
                self.sizes.remove(c)
                raise LoadError(f"CUDA graph replay at {c} tokens differs from the graph-less run "
                                f"(max abs diff {float((g - w).abs().max()):.3g}); set "
                                "`cudagraph: none` in the manifest and report this")

    def _pad(self, inputs: Sequence[torch.Tensor], c: int) -> list[torch.Tensor]:
        out = []
        for x, spec in zip(inputs, self.runner.program.inputs):
            dims = [d for d, s in enumerate(spec["shape"]) if s == "tokens"]
            if not dims or x.shape[dims[0]] == c:
                out.append(x)
                continue
            shape = list(x.shape)
            shape[dims[0]] = c
            p = x.new_zeros(shape)
            p.narrow(dims[0], 0, x.shape[dims[0]]).copy_(x)
            out.append(p)
        return out


def _cut(out: Any, n: int, dims: Sequence[int]) -> Any:
    """Each output tensor narrowed to ``n`` along its token dim (``dims``, flat order), copied."""
    flat = iter(dims)

    def cut(t: Any) -> Any:
        if isinstance(t, (list, tuple)):
            return type(t)(cut(x) for x in t)
        d = next(flat)
        return t.narrow(d, 0, n).clone() if isinstance(t, torch.Tensor) else t

    return cut(out)


def _shapes(out: Any) -> list[tuple[int, ...] | None]:
    return [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in flat_tensors(out)]


def _second_size(program: Any, sizes: Sequence[int]) -> int | None:
    """A size the program serves besides ``sizes[0]``: another capture size, else a neighbour."""
    others = [s for s in sizes[1:] if s != sizes[0]]
    if others:
        return others[0]
    for n in (sizes[0] - 1, sizes[0] + 1):
        if 1 <= n <= program.max_tokens and (n >= program.min_dynamic_tokens or n in program.compile_sizes):
            return n
    return None


def output_token_dims(runner: Runner, sizes: Sequence[int]) -> list[int]:
    """Per flat output, the dim that follows the token count: the program run without graphs
    at ``sizes[0]`` and at a second size it serves (the only dim whose extent equals the size
    when there is no second one). ``LoadError`` for an output with no such dim: padded rows
    could not be cut back out of it."""
    a, b = sizes[0], _second_size(runner.program, sizes)
    with torch.no_grad():
        at_a = _shapes(runner.run_at(runner.dummy_inputs(a), a))
        at_b = _shapes(runner.run_at(runner.dummy_inputs(b), b)) if b is not None else None
    dims = []
    for i, shape in enumerate(at_a):
        if shape is None:  # not a tensor: handed back as it is
            dims.append(-1)
            continue
        other = at_b[i] if at_b is not None else None
        found = [d for d, e in enumerate(shape) if e == a and (
            other[d] == b if other is not None else True)]
        if len(found) != 1 and other is not None:  # e.g. [n, n]: the first dim that follows
            found = found[:1]
        if len(found) != 1:
            raise LoadError(f"graph output {i} of shape {list(shape)} has no dim that follows the "
                            f"token count ({a} tokens); padding could not be cut back out of it: "
                            "set `cudagraph: none`")
        dims.append(found[0])
    return dims


class GraphedRunner:
    """A runner with CUDA graphs around it: a call of up to the largest capture size replays
    the graphs, any other runs the graph set's runner plainly. What callers read of a runner is
    here by name (``program``, ``model``, ``key``, ``timings``, ``input_names``, ``eager``,
    ``warmup``); :attr:`runner` is the runner it runs (piecewise: the graph set's own, its
    pieces wrapped), :attr:`graphs` the graph set."""

    def __init__(self, graphs: GraphSet) -> None:
        self.graphs = graphs
        self.runner: Runner = graphs.runner

    @property
    def program(self) -> Program:
        return self.runner.program

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def key(self) -> str:
        return self.runner.key

    @property
    def timings(self) -> Timings:
        return self.runner.timings

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.runner.input_names

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The bound model itself, called as the program is (:meth:`Runner.eager`)."""
        return self.runner.eager(*args, **kwargs)

    def warmup(self, sizes: Sequence[int] | None = None) -> float:
        """Run every compiled artifact once without graphs (:meth:`Runner.warmup`)."""
        return self.runner.warmup(sizes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs, n = self.runner.prepare(args, kwargs)
        c = self.graphs.serves(n)
        if c is None:
            return self.runner.run_at(inputs, n)
        with torch.no_grad():
            return self.graphs.run(inputs, n, c)


def capture(runner: Runner, mode: str, sizes: Sequence[int], graph_cls: type = CudaGraph,
            device: str = "cuda") -> GraphedRunner | None:
    """Capture ``runner``'s graphs for each servable size in ``sizes``, largest first, in one
    pool, and wrap it; None for mode ``none`` or no size. ``runner`` itself is never changed:
    the graphs are captured around a runner built from its artifacts with each compiled piece
    wrapped (:class:`GraphSet`). Raises ``LoadError`` when a capture fails."""
    if mode == "none":
        return None
    if isinstance(runner, GraphedRunner):
        raise LoadError("this runner's pieces are already captured into CUDA graphs; capture "
                        "from the plain runner (its .runner) or load it again")
    program = runner.program
    servable = sorted({int(c) for c in sizes if 1 <= int(c) <= program.max_tokens and (
        int(c) >= program.min_dynamic_tokens or int(c) in program.compile_sizes)}, reverse=True)
    if not servable:
        return None
    graphs = GraphSet(runner, mode, graph_cls)
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    before = torch.cuda.memory_reserved() if cuda else 0
    t = time.perf_counter()
    with kept(runner.bound_buffers()):  # the probe runs the model: its state (a KV cache) is kept
        graphs.token_dims = output_token_dims(runner, servable)
    with kept(runner.bound_buffers()):  # capture runs the model: its state (a KV cache) is kept
        for c in servable:
            try:
                graphs.capture_size(c)
            except LoadError:
                raise
            except Exception as e:  # noqa: BLE001 - a capture error must name the size and the fix
                raise LoadError(f"capturing {mode} CUDA graphs at {c} tokens failed "
                                f"({type(e).__name__}: {e}); use `cudagraph: piecewise` "
                                "(attention eager) or `none`") from e
    if cuda:
        torch.cuda.synchronize()
    graphs.report.seconds = time.perf_counter() - t
    graphs.report.sizes = list(servable)
    graphs.report.pool_bytes = (torch.cuda.memory_reserved() - before) if cuda else 0
    runner.timings.add("capture", graphs.report.seconds)
    return GraphedRunner(graphs)
