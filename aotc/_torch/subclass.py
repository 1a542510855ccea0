"""Tensor subclasses (torchao's quantized weights) as inputs of a compiled graph: what one is,
and the plain inner tensors AOTAutograd passes the compiled code in its place, in its order
(``torch._functorch._aot_autograd.subclass_utils.unwrap_tensor_subclasses``: depth first, in
``__tensor_flatten__`` order). Tested on torch 2.11–2.13."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["flatten_spec", "flattened", "inner_paths", "is_subclass"]


def is_subclass(v: Any) -> bool:
    """A traceable wrapper subclass instance (it flattens into inner tensors)."""
    return isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, torch.nn.Parameter) \
        and hasattr(v, "__tensor_flatten__")


def inner_paths(t: Any, prefix: str = "") -> list[str]:
    """The attribute paths (``a.b`` for a nested subclass) of a subclass's plain inner tensors,
    in AOTAutograd's order; ``ValueError`` when an inner value is not a tensor."""
    paths: list[str] = []
    for attr in t.__tensor_flatten__()[0]:
        inner = getattr(t, attr)
        path = f"{prefix}{attr}"
        if is_subclass(inner):
            paths += inner_paths(inner, path + ".")
        elif isinstance(inner, torch.Tensor):
            paths.append(path)
        else:
            raise ValueError(f"a subclass input's inner value {path!r} is not a tensor")
    return paths


def flatten_spec(inputs: Sequence[Any]) -> dict[str, list[str]]:
    """Per subclass input (its position as text), the inner tensors the compiled code takes in
    its place; ``ValueError`` for a subclass of symbolic shape (its sizes would be passed too)."""
    spec: dict[str, list[str]] = {}
    for i, v in enumerate(inputs):
        if is_subclass(v):
            if any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
                raise ValueError("a tensor-subclass input of dynamic shape")
            spec[str(i)] = inner_paths(v)
    return spec


def flattened(args: Sequence[Any], spec: dict[int, list[list[str]]]) -> list[Any]:
    """``args`` with each subclass input (``spec``: position -> split attribute paths) replaced
    by its inner tensors."""
    out: list[Any] = []
    for i, a in enumerate(args):
        paths = spec.get(i)
        if paths is None:
            out.append(a)
            continue
        for path in paths:
            v = a
            for attr in path:
                v = getattr(v, attr)
            out.append(v)
    return out
