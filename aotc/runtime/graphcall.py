"""The runtime of a program compiled from a graph Dynamo handed the ``torch.compile`` backend:
called with the graph's own inputs, in order, as Dynamo (or vLLM's saved AOT function) calls a
backend's result. Weights, size symbols and opaque values (vLLM's ``LayerName``) all arrive as
arguments and pass straight through to the pieces; nothing is bound or baked in.

Size dispatch: the token count is the value of the graph's size-symbol inputs (vLLM's graph has
two, the lengths of ``input_ids`` and ``positions``). A compile size's static artifact serves a
call only when every symbol equals that size; any other call runs the dynamic artifact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from aotc.errors import AotcError, InputError, RunError
from aotc.records.graphcode import GraphProgram
from aotc.records.program import Program
from aotc.runtime.runner import Artifact, PieceCall, SplittingCall, Timings, kernel_text

__all__ = ["GraphRunner"]


class _HookedSplitting:
    """A splitting piece run through the runner's ``splitting_hook`` when one is set."""

    def __init__(self, runner: GraphRunner, name: str, call: SplittingCall) -> None:
        self.runner, self.name, self.call = runner, name, call

    def __call__(self, *args: Any) -> Any:
        hook = self.runner.splitting_hook
        return self.call(*args) if hook is None else hook(self.name, self.call, args)


class GraphRunner:
    """``runner(*graph_args)``: the stitched program of one Dynamo graph (see module doc)."""

    graphs: Any = None

    def __init__(self, program: Program, artifacts: Mapping[str, Mapping[int | None, Artifact]],
                 key: str = "", timings: Timings | None = None,
                 modules: Mapping[str, Callable[..., Any]] | None = None) -> None:
        """``modules`` replaces the compiled pieces by name (the compile-time reference runs the
        pieces' own graphs eagerly through the same stitch)."""
        self.program, self.key = program, key
        self.timings = timings or Timings()
        self._local = threading.local()
        self.piece_hook: Callable[[str, Artifact, Sequence[Any]], Any] | None = None
        # Runs each splitting piece in place of a plain call when set: ``hook(name, fn, args)``
        self.splitting_hook: Callable[[str, Callable[..., Any], Sequence[Any]], Any] | None = None
        self._stitch = GraphProgram(program.stitch)
        self._modules: dict[str, Callable[..., Any]] = {}
        for p in program.pieces:
            if p.kind == "compiled":
                if modules is not None and p.name in modules:
                    self._modules[p.name] = modules[p.name]
                else:
                    self._modules[p.name] = PieceCall(self, p.name, str(p.uid), artifacts[str(p.uid)],
                                                      p.returns_tuple, p.layouts)
            else:
                call = SplittingCall(GraphProgram(p.graph or {"nodes": []}))
                self._modules[p.name] = _HookedSplitting(self, p.name, call)
        self._symbols = [int(s.index) for s in program.slots if s.kind == "symbol"]  # type: ignore[arg-type]  # a slot of this kind always has index (and dim)
        dims = [(int(s.index), int(s.dim)) for s in program.slots  # type: ignore[arg-type]  # a slot of this kind always has index (and dim)
                if s.kind == "input" and s.dim is not None]
        self._token_dim = dims[0] if dims else None
        self.sizes = frozenset(program.compile_sizes)

    @property
    def current_tokens(self) -> int:
        """The token count of the call in flight on this thread (0: the dynamic artifacts)."""
        return int(getattr(self._local, "tokens", 0))

    def tokens_of(self, args: Sequence[Any]) -> int:
        """The call's token count when every size symbol agrees on one, else 0."""
        if self._symbols:
            values = {int(args[i]) for i in self._symbols}
            return values.pop() if len(values) == 1 else 0
        if self._token_dim is not None:
            i, d = self._token_dim
            return int(args[i].shape[d])
        return 0

    def kernel_error(self, piece: PieceCall, n: int, e: BaseException) -> AotcError:
        """A compiled kernel's failure, named by piece and size."""
        what = f"{n} tokens" if n else "dynamic"
        return RunError(f"piece {piece.name} (unique piece {piece.uid[:8]}, {what}) failed: "
                        f"{kernel_text(e)}")

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self.program.slots):
            raise InputError(f"the compiled graph takes {len(self.program.slots)} inputs, got "
                             f"{len(args)} (called with another graph's inputs?)")
        n = self.tokens_of(args)
        self._local.tokens = n if n in self.sizes else 0
        with torch.no_grad():
            return self._stitch(self._modules, *args)
