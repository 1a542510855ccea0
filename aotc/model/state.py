"""A module's parameters and buffers by their names (the ``fqn`` a Program binds by)."""

from __future__ import annotations

import torch

__all__ = ["named_buffers", "named_tensors"]


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name, shared ones under each of their names."""
    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state.update(named_buffers(model))
    return state


def named_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of ``model`` by name (what a stateful forward may write)."""
    return dict(model.named_buffers(remove_duplicate=False))
