"""The runtime of a program compiled from a graph Dynamo handed the ``torch.compile`` backend:
called with the graph's own inputs, in order, as Dynamo (or vLLM's saved AOT function) calls a
backend's result. Weights, size symbols and opaque values (vLLM's ``LayerName``) all arrive as
arguments and pass straight through to the pieces; nothing is bound or baked in.

Size dispatch: the token count is the value of the graph's size-symbol inputs (vLLM's graph has
two, the lengths of ``input_ids`` and ``positions``). A compile size's static artifact serves a
call only when every symbol equals that size; any other call runs the dynamic artifact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aotc.errors import InputError
from aotc.records.program import Program
from aotc.runtime.stitched import Artifact, PieceWrap, StitchedProgram, Timings

__all__ = ["GraphRunner"]


class GraphRunner(StitchedProgram):
    """``runner(*graph_args)``: the stitched program of one Dynamo graph (see module doc).
    ``modules``, ``wrap_piece``, ``wrap_splitting``: see
    :class:`~aotc.runtime.stitched.StitchedProgram`."""

    def __init__(self, program: Program, artifacts: Mapping[str, Mapping[int | None, Artifact]],
                 key: str = "", timings: Timings | None = None,
                 modules: Mapping[str, Callable[..., Any]] | None = None, *,
                 wrap_piece: PieceWrap | None = None, wrap_splitting: PieceWrap | None = None) -> None:
        super().__init__(program, artifacts, key, timings, modules, wrap_piece=wrap_piece,
                         wrap_splitting=wrap_splitting)
        self._symbols = [int(s.index) for s in program.slots if s.kind == "symbol"]  # type: ignore[arg-type]  # a symbol slot has an index
        dims = [(int(s.index), int(s.dim)) for s in program.slots  # type: ignore[arg-type]  # an input slot with a dim has both
                if s.kind == "input" and s.dim is not None]
        self._token_dim = dims[0] if dims else None
        self.sizes = frozenset(program.compile_sizes)

    def tokens_of(self, args: Sequence[Any]) -> int:
        """The call's token count when every size symbol agrees on one, else 0."""
        if len(self._symbols) == 1:
            return int(args[self._symbols[0]])
        if self._symbols:
            values = {int(args[i]) for i in self._symbols}
            return values.pop() if len(values) == 1 else 0
        if self._token_dim is not None:
            i, d = self._token_dim
            return int(args[i].shape[d])
        return 0

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self.program.slots):
            raise InputError(f"the compiled graph takes {len(self.program.slots)} inputs, got "
                             f"{len(args)} (called with another graph's inputs?)")
        n = self.tokens_of(args)
        return self.run_stitch(n if n in self.sizes else 0, args)
