"""A CPU stand-in for ``torch.cuda.CUDAGraph`` that models capture as CUDA does, so that the
graph bookkeeping of ``aotc.runtime.cudagraph`` is tested where there is no GPU:

- **capture records and runs nothing.** ``fn`` runs once so the stand-in learns what to replay,
  then every visible effect is undone: the arguments get their contents back and the outputs are
  filled with garbage (NaN; the largest value of an integer dtype) until the first replay. Code
  that reads a captured output before replaying reads garbage, as on a GPU.
- **a host sync during capture raises** (``item``, ``tolist``, ``bool``/``int``/``float`` of a
  tensor, ``cpu``, ``numpy``, ``nonzero``): CUDA's capture forbids them (``cudaErrorStreamCapture…``).
- **replay re-runs the recorded work** on the captured argument tensors' current contents, into
  the SAME output tensors — so a missed copy into a static buffer, an output handed out without
  a copy, or a wrong padding shows up as a wrong result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
          torch.Tensor.nonzero, torch.nonzero}


class HostSyncDuringCapture(RuntimeError):
    """What CUDA raises for a host sync inside a stream capture."""


class _NoHostSync(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func in _SYNCS:
            raise HostSyncDuringCapture(f"{getattr(func, '__name__', func)} during CUDA graph capture "
                                        "(operation not permitted when stream is capturing)")
        return func(*args, **(kwargs or {}))


def _flat(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _garbage(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class EmulatedGraph:
    """``capture(fn, args)`` / ``replay()`` / ``new_pool()`` as ``aotc.runtime.cudagraph.CudaGraph``
    (module doc). ``captured`` counts captures over the process."""

    captured = 0

    def __init__(self, pool: object) -> None:
        self.pool = pool

    @staticmethod
    def new_pool() -> object:
        return object()

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        EmulatedGraph.captured += 1
        before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
        with torch.no_grad(), _NoHostSync():
            out = fn(*args)
        with torch.no_grad():
            for a, b in zip(args, before):  # nothing ran: the arguments are as they were
                if b is not None:
                    a.copy_(b)
            for t in _flat(out):  # and the outputs hold whatever the pool held
                if isinstance(t, torch.Tensor):
                    _garbage(t)
        self.fn, self.args, self.out = fn, args, out
        return out

    def replay(self) -> None:
        with torch.no_grad():
            new = self.fn(*self.args)
            for o, n in zip(_flat(self.out), _flat(new)):
                if isinstance(o, torch.Tensor):
                    o.copy_(n)
