"""A boolean attention mask turned into an additive one once, in a compiled piece, instead of in
every attention call.

``scaled_dot_product_attention`` with a boolean ``attn_mask`` converts it on every call, in ATen,
into the query's dtype: ``where(mask, scalar_tensor(0.0), scalar_tensor(-inf))`` (the ops
``make_fx`` records for it on torch 2.11–2.13), then runs the kernel on the float mask. A
transformers model hands every layer the same mask, so a graph split at attention converted
it once per layer per call, eagerly (2 ``where`` + 2 ``scalar_tensor`` a layer; Inductor's whole
graph does it once and fuses it). This pass, run on the captured graph before the split, puts
those same ops once per (mask, dtype) right after the mask is made — in the compiled piece that
makes it — and gives every attention call the float mask. SDPA passes a float mask through as
it is, so the result is the same bits (tested). CPU masks only: on CUDA, SDPA chooses among its
kernels (cuDNN converts a boolean mask its own way) and that has not been checked on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from aotc._torch.fake import run_like

__all__ = ["hoist_boolean_masks"]

_SDPA = "aten::scaled_dot_product_attention"
_MASK_POSITION = 3  # scaled_dot_product_attention(query, key, value, attn_mask, ...)


def _example(node: Any) -> Any:
    if isinstance(node, torch.fx.Node):
        for k in ("example_value", "val"):
            if isinstance(node.meta.get(k), torch.Tensor):
                return node.meta[k]
    return None


def _mask_of(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype] | None:
    """The boolean mask node of an SDPA call and the query's dtype, or None."""
    if "attn_mask" in node.kwargs:
        mask = node.kwargs["attn_mask"]
    elif len(node.args) > _MASK_POSITION:
        mask = node.args[_MASK_POSITION]
    else:
        return None
    query = node.args[0] if node.args else node.kwargs.get("query")
    m, q = _example(mask), _example(query)
    if m is None or q is None or m.dtype != torch.bool or not q.dtype.is_floating_point \
            or m.device.type != "cpu":  # (CUDA picks among kernels by the mask: not verified there)
        return None
    return mask, q.dtype  # type: ignore[return-value]  # _example returned a tensor: mask is a Node


def _with_mask(node: torch.fx.Node, new: torch.fx.Node) -> None:
    if "attn_mask" in node.kwargs:
        node.kwargs = {**node.kwargs, "attn_mask": new}
    else:
        args = list(node.args)
        args[_MASK_POSITION] = new
        node.args = tuple(args)


def _converted(graph: torch.fx.Graph, mask: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node | None:
    """ATen's conversion of ``mask`` into ``dtype``, as nodes right after the mask is made (after
    the inputs when it is one), each with its example value; None when the example value
    cannot be computed (the call keeps its boolean mask)."""
    example = _example(mask)
    device = example.device

    def conversion(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        zero = torch.scalar_tensor(0.0, dtype=dtype, device=device)
        ninf = torch.scalar_tensor(float("-inf"), dtype=dtype, device=device)
        return zero, ninf, torch.where(m, zero, ninf)

    values = run_like(example, conversion)  # the three nodes' example values, in one run
    if values is None:
        return None
    anchor = mask if mask.op != "placeholder" else \
        next(n for n in graph.nodes if n.op != "placeholder").prev
    kwargs = {"dtype": dtype, "device": device}
    with graph.inserting_after(anchor):
        z = graph.call_function(torch.scalar_tensor, (0.0,), kwargs)
    with graph.inserting_after(z):
        n = graph.call_function(torch.scalar_tensor, (float("-inf"),), kwargs)
    with graph.inserting_after(n):
        new = graph.call_function(torch.where, (mask, z, n))
    key = "example_value" if "example_value" in mask.meta else "val"
    for node, value in zip((z, n, new), values):
        node.meta[key] = value
    return new


def hoist_boolean_masks(gm: torch.fx.GraphModule, names_of: Callable[[torch.fx.Node], set[str]],
                        splitting: set[str]) -> int:
    """Rewrite ``gm`` in place (module doc): each SDPA call that is a splitting op (one of its
    names, ``names_of(node)``, in ``splitting``) and whose mask is boolean gets the mask
    converted once, where it is made. Returns how many calls were rewritten (0: the graph is
    untouched)."""
    converted: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node | None] = {}
    rewritten = 0
    graph = gm.graph
    for node in list(graph.nodes):
        names = names_of(node)
        if node.op != "call_function" or _SDPA not in names or not names & splitting:
            continue
        found = _mask_of(node)
        if found is None:
            continue
        if found not in converted:
            converted[found] = _converted(graph, *found)
        new = converted[found]
        if new is not None:
            _with_mask(node, new)
            rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
