"""Inputs made for a static-size compile of a piece and for its fast-path check: real,
uninitialized-but-valid tensors with every symbolic size set to the size — part of the fence
around ``torch._inductor`` (fake tensors, tensor subclasses' flatten protocol). Tested on torch
2.13 (CPU); written for 2.11–2.13."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aotc._torch.subclass import is_subclass

__all__ = ["concrete_size", "is_fake", "static_example_inputs"]


def concrete_size(x: Any, size: int) -> int:
    """An int for a (possibly symbolic) size, every free symbol taken as the token size."""
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        return int(expr.subs({s: size for s in expr.free_symbols}))
    return int(x)


def static_example_inputs(example_inputs: Sequence[Any], size: int) -> list[Any]:
    """Real (uninitialized-but-valid) inputs with every symbolic size set to ``size``.

    Integer tensors are zero-filled (valid indices); float tensors are left uninitialized
    (``torch.empty``: no cost for large weights). ``SymInt`` inputs become ``size``-derived ints.
    A tensor subclass (torchao's quantized weight; of fixed shape) stays one: a real one is
    passed as it is, a fake one (the manifest door's trace) rebuilt from inputs made so for its
    inner tensors — an empty tensor of its outer shape would be a plain tensor, and the code
    compiled for it read the subclass's unallocated storage at run time.
    """
    return [_example(v, size) for v in example_inputs]


def _example(v: Any, size: int) -> Any:
    if is_subclass(v) and not any(isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride())):
        if not is_fake(v):
            return v
        names, ctx = v.__tensor_flatten__()
        inner = {name: _example(getattr(v, name), size) for name in names}
        return type(v).__tensor_unflatten__(inner, ctx, tuple(v.shape), tuple(v.stride()))
    if isinstance(v, torch.Tensor):
        shape = [concrete_size(s, size) for s in v.shape]
        stride = [concrete_size(s, size) for s in v.stride()]
        t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
        if not (v.dtype.is_floating_point or v.dtype.is_complex):
            t.zero_()
        elif v.requires_grad:  # a training compile's static artifact takes grads as well
            t.requires_grad_(True)
        return t
    if isinstance(v, torch.SymInt):
        return concrete_size(v, size)
    return v


def is_fake(v: torch.Tensor) -> bool:
    """A fake tensor, or a subclass with one inside (no data to run on)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(v, FakeTensor) or v.device.type == "meta":
        return True
    if not is_subclass(v):
        return False
    names = v.__tensor_flatten__()[0]  # type: ignore[attr-defined]  # is_subclass checked it
    return any(is_fake(getattr(v, n)) for n in names if isinstance(getattr(v, n), torch.Tensor))
