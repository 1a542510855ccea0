"""Running an op on a graph's example value: a ``FakeTensor`` (Dynamo's ``example_value``, with
symbolic sizes) under its own fake mode, a real tensor as it is. ``FakeTensor.fake_mode`` is
torch's private attribute; tested on torch 2.11–2.13."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_like"]


def run_like(example: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn(example)`` where ``example`` lives: under its fake mode when it is a fake tensor (so
    the result is fake too, sizes symbolic alike), plainly for a real one; None for a tensor of
    another kind (a meta tensor, a subclass) or when the op cannot run so (the caller then
    leaves the graph as it is)."""
    mode = getattr(example, "fake_mode", None)
    try:
        if mode is not None:
            with mode:
                return fn(example)
        if type(example) is torch.Tensor and example.device.type != "meta":
            return fn(example)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None
    return None
