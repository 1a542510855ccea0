"""How aotc calls a model: by the manifest's input names, returning the declared output.

This file is traced with every model (it is in the ``code`` key factor), so it is kept tiny.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class ByName(torch.nn.Module):
    """What aotc traces and checks against: ``ByName(model, names, output)(*inputs)`` calls
    ``model(**dict(zip(names, inputs)))`` -- by keyword, so each input reaches the parameter the
    manifest names whatever the forward's order -- and returns the declared output: one field /
    index of a dataclass or tuple output, a tuple of several, or the output as it is.
    Parameters keep the model's own names (:func:`unwrap`)."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str],
                 output: str | int | Sequence[str | int] | None = None) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.output = output

    def forward(self, *args: Any) -> Any:
        return pick_output(self.model(**dict(zip(self.names, args))), self.output)


def pick_output(out: Any, output: str | int | Sequence[str | int] | None) -> Any:
    """The declared output(s) of a model's return value (``output:`` in the manifest)."""
    if output is None:
        return out
    if isinstance(output, (list, tuple)):
        return tuple(pick_output(out, o) for o in output)
    if isinstance(output, int) or isinstance(out, Mapping):  # a dict / ModelOutput: by key
        return out[output]
    return getattr(out, str(output))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a :class:`ByName` (parameter names are relative to it)."""
    return model.model if isinstance(model, ByName) else model
