"""The runtime of a stitched program: feed the graph from a live module + user inputs, dispatch
each compiled piece by token count (static artifact for that size, else the dynamic one), run
splitting pieces (attention) eagerly. No Dynamo, no compiler."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aotc.errors import AotcError, InputError, LoadError, RunError
from aotc.model.build import DTYPES
from aotc.model.forward import ByName, unwrap
from aotc.model.state import named_tensors
from aotc.records.program import Program
from aotc.runtime.checking import kept
from aotc.runtime.stitched import Artifact, PieceCall, PieceWrap, StitchedProgram, Timings, kernel_text

__all__ = ["Runner"]


class Runner(StitchedProgram):
    """``runner(*inputs)`` or ``runner(name=tensor, …)``: the compiled model, bound to ``model``'s
    parameters and buffers (by their names in ``model``: the server's own module, e.g. what
    ``transformers`` returns). Returns the declared output (a tuple when several are declared).
    ``wrap_piece`` / ``wrap_splitting``: see :class:`~aotc.runtime.stitched.StitchedProgram`."""

    def __init__(self, program: Program, artifacts: Mapping[str, Mapping[int | None, Artifact]],
                 model: torch.nn.Module, key: str = "", timings: Timings | None = None, *,
                 wrap_piece: PieceWrap | None = None, wrap_splitting: PieceWrap | None = None) -> None:
        t0 = time.perf_counter()
        super().__init__(program, artifacts, key, timings, wrap_piece=wrap_piece,
                         wrap_splitting=wrap_splitting)
        self.model = unwrap(model)
        self.input_names = tuple(str(s["name"]) for s in program.inputs)
        self._bind(self.model)
        self.timings.add("bind", time.perf_counter() - t0)

    def wrapped(self, *, wrap_piece: PieceWrap | None = None,
                wrap_splitting: PieceWrap | None = None) -> Runner:
        """A new runner over this one's program, artifacts, model and timings whose pieces go
        through the given wrappers (this runner is left as it is): how CUDA graphs are put
        around the pieces."""
        return Runner(self.program, self.artifacts, self.model, self.key, self.timings,
                      wrap_piece=wrap_piece, wrap_splitting=wrap_splitting)

    def _bind(self, model: torch.nn.Module) -> None:
        state = named_tensors(model)
        self._bound: list[Any] = []
        for slot in self.program.slots:
            if slot.kind not in ("param", "buffer"):
                self._bound.append(None)
                continue
            t = state.get(str(slot.fqn))
            if t is None:
                raise LoadError(f"the model has no {slot.kind} {slot.fqn!r} that the compiled "
                                f"program takes; bind the module the manifest describes "
                                f"({type(model).__name__} has e.g. {next(iter(state), 'nothing')!r})")
            if t.device.type != torch.device(self.program.device).type:
                raise LoadError(f"{slot.kind} {slot.fqn!r} is on {t.device}, the program runs on "
                                f"{self.program.device}; move the model first")
            if slot.dtype is not None and str(t.dtype).removeprefix("torch.") != slot.dtype:
                raise LoadError(f"{slot.kind} {slot.fqn!r} is {t.dtype}, the program was compiled "
                                f"for {slot.dtype}")
            if slot.shape is not None and list(t.shape) != list(slot.shape):
                raise LoadError(f"{slot.kind} {slot.fqn!r} has shape {list(t.shape)}, the program "
                                f"was compiled for {slot.shape}")
            self._bound.append(t)

    def arrange(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """The inputs in the program's order from a positional and/or keyword call (the
        manifest's input names); an unknown, repeated or missing name is an ``InputError``."""
        names = self.input_names
        if not kwargs:
            if len(args) != len(names):
                raise InputError(f"expected {len(names)} inputs ({', '.join(names)}), got {len(args)}")
            return list(args)
        if len(args) > len(names):
            raise InputError(f"expected {len(names)} inputs ({', '.join(names)}), got {len(args)} "
                             "positional ones")
        given: dict[str, Any] = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise InputError(f"unknown input {k!r}; the program takes {', '.join(names)}")
            if k in given:
                raise InputError(f"input {k!r} given twice (by position and by name)")
            given[k] = v
        missing = [n for n in names if n not in given]
        if missing:
            raise InputError(f"missing input {missing[0]!r}; the program takes {', '.join(names)}")
        return [given[n] for n in names]

    def check_inputs(self, inputs: Sequence[Any]) -> int:
        """Validate inputs (in the program's order) against the recorded spec; return the token
        count."""
        specs = self.program.inputs
        if len(inputs) != len(specs):
            raise InputError(f"expected {len(specs)} inputs ({', '.join(s['name'] for s in specs)}), "
                             f"got {len(inputs)}")
        n: int | None = None
        for t, spec in zip(inputs, specs):
            name = spec["name"]
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {name!r}: expected a tensor, got {type(t).__name__}")
            if t.dtype != DTYPES[spec["dtype"]]:
                raise InputError(f"input {name!r}: expected dtype {spec['dtype']}, got "
                                 f"{str(t.dtype).removeprefix('torch.')}")
            if t.dim() != len(spec["shape"]):
                raise InputError(f"input {name!r}: expected rank {len(spec['shape'])} "
                                 f"{spec['shape']}, got shape {list(t.shape)}")
            if t.device.type != torch.device(self.program.device).type:
                raise InputError(f"input {name!r}: expected device {self.program.device}, got {t.device}")
            for d, want in enumerate(spec["shape"]):
                got = int(t.shape[d])
                if want == "tokens":
                    if n is not None and got != n:
                        raise InputError(f"input {name!r}: dim {d} has {got} tokens, other inputs have {n}")
                    n = got
                elif got != want:
                    raise InputError(f"input {name!r}: dim {d} must be {want}, got {got}")
        if n is None:
            n = 0
        if not 1 <= n <= self.program.max_tokens:
            raise InputError(f"token count {n} is outside [1, max_tokens={self.program.max_tokens}]")
        if n < self.program.min_dynamic_tokens and n not in self.program.compile_sizes:
            raise InputError(f"{n} tokens: the dynamic artifact serves >= "
                             f"{self.program.min_dynamic_tokens}; add {n} to compile_sizes")
        return n

    def kernel_error(self, piece: PieceCall, n: int, e: BaseException) -> AotcError:
        """A compiled kernel's failure, told in the caller's terms: which piece at which size,
        the kernel's own words without compile-time paths, and an input outside the range the
        manifest declares (a token id beyond the vocabulary) when the call has one."""
        text = kernel_text(e)
        inputs = getattr(self._local, "inputs", None) or ()
        for t, spec in zip(inputs, self.program.inputs):
            high, low = spec.get("high"), spec.get("low") or 0
            if high is None or t.dtype.is_floating_point or t.dtype == torch.bool or not t.numel() \
                    or t.device.type != "cpu":  # a device's error state: do not touch it again
                continue
            lo, hi = int(t.min()), int(t.max())
            if lo < low or hi >= high:
                bad = hi if hi >= high else lo
                return InputError(f"input {spec['name']!r} holds {bad}, outside [{low}, {high}) "
                                  f"(the manifest's low/high); piece {piece.name} ({n} tokens) "
                                  f"failed: {text}")
        return RunError(f"piece {piece.name} (unique piece {piece.uid[:8]}, {n} tokens) failed: {text}")

    def bound_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers the program reads (and may write: a KV cache), by name."""
        return {str(s.fqn): t for s, t in zip(self.program.slots, self._bound) if s.kind == "buffer"}

    def bound_tensors(self) -> list[torch.Tensor]:
        """The model's parameters and buffers the program reads (fixed addresses)."""
        return [t for t in self._bound if t is not None]

    def dummy_inputs(self, n: int) -> list[torch.Tensor]:
        """Zero inputs of ``n`` tokens (warm-up and graph capture)."""
        return [torch.zeros([n if d == "tokens" else int(d) for d in s["shape"]],
                            dtype=DTYPES[s["dtype"]], device=self.program.device)
                for s in self.program.inputs]

    def warmup(self, sizes: Sequence[int] | None = None) -> float:
        """Run every compiled artifact once (default: each compile size and one dynamic size) on
        zero inputs, so the first real call pays no one-time cost (torch's custom-op machinery,
        kernel libraries' first touch). Buffers the program mutates (a KV cache) are restored
        afterwards. Returns the seconds it took."""
        t0 = time.perf_counter()
        if sizes is None:
            dyn = [n for n in range(max(2, self.program.min_dynamic_tokens), self.program.max_tokens + 1)
                   if n not in self.program.compile_sizes][:1]
            sizes = [*self.program.compile_sizes, *dyn]
        with kept(self.bound_buffers()):
            for n in sizes:
                self.run_at(self.dummy_inputs(int(n)), int(n))
        seconds = time.perf_counter() - t0
        self.timings.add("warmup", seconds)
        return seconds

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The bound model itself, called as the program is (by name, declared output picked):
        the reference a compiled call is compared with."""
        with torch.no_grad():
            return ByName(self.model, self.input_names, self.program.output)(*self.arrange(args, kwargs))

    def prepare(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], int]:
        """A call's inputs in the program's order, contiguous (a strided view such as
        ``ids[::2]`` is copied) and checked; and its token count."""
        inputs = [t.contiguous() if isinstance(t, torch.Tensor) else t
                  for t in self.arrange(args, kwargs)]
        return inputs, self.check_inputs(inputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs, n = self.prepare(args, kwargs)
        return self.run_at(inputs, n)

    def run_at(self, inputs: Sequence[torch.Tensor], n: int) -> Any:
        """Run the stitched program on checked inputs of ``n`` tokens (no graphs replayed unless
        the graph set is replaying)."""
        self._local.inputs = inputs
        args = []
        for slot, bound in zip(self.program.slots, self._bound):
            if bound is not None:
                args.append(bound)
            elif slot.kind == "input":
                args.append(inputs[int(slot.index)])  # type: ignore[arg-type]  # an input/symbol slot always has index (and dim)
            else:
                args.append(int(inputs[int(slot.index)].shape[int(slot.dim)]))  # type: ignore[arg-type]  # an input/symbol slot always has index (and dim)
        try:
            out = self.run_stitch(n, args)
        finally:
            self._local.inputs = None
        if isinstance(self.program.output, (list, tuple)):
            return tuple(out)
        if isinstance(out, (list, tuple)) and len(out) == 1:
            return out[0]
        return out
