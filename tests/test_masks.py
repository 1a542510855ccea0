"""A boolean attention mask converted once, in a compiled piece, not in every attention call
(aotc/compile/masks.py): real Dynamo captures, split at SDPA, the pieces run as FX graphs (no
Inductor), outputs compared bit for bit with eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aotc.compile.capture import capture, graph_args
from aotc.compile.split import split

SDPA = ["aten::scaled_dot_product_attention"]


class TwoLayers(torch.nn.Module):
    """Two attention layers sharing one boolean mask: causal, made in the graph (``made``;
    ``padded`` masks out the first key too, so the first row is all masked), or passed in."""

    def __init__(self, made: bool = True, padded: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.made, self.padded = made, padded
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(16, 48, dtype=dtype) for _ in range(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.made:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
            if self.padded:
                mask = mask & (torch.arange(t, device=x.device) > 0)
        for qkv in self.qkv:
            q, k, v = qkv(x).view(1, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(1, t, 16)
        return x


def _inputs(t: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """``x`` and a key padding mask (the last key masked), for the model that takes its mask."""
    g = torch.Generator().manual_seed(t)
    return [torch.randn(1, t, 16, generator=g).to(dtype), torch.arange(t)[None, None, None] < t - 1]


def _attention_masks(parts) -> list[torch.dtype]:
    """The dtype of the mask each attention piece is handed (an input of the piece)."""
    out = []
    for p in parts.pieces:
        if p.is_splitting:
            (call,) = [n for n in p.gm.graph.nodes if n.op == "call_function"]
            mask = call.kwargs.get("attn_mask", call.args[3] if len(call.args) > 3 else None)
            inputs = list(p.gm.graph.find_nodes(op="placeholder"))
            out.append(p.example_inputs[inputs.index(mask)].dtype)
    return out


@pytest.mark.parametrize("made,padded,dtype", [(True, False, torch.float32), (True, True, torch.float32),
                                               (False, False, torch.float32), (True, True, torch.bfloat16)])
def test_mask_converted_once_and_bits_equal(made, padded, dtype):
    model = TwoLayers(made, padded, dtype).eval()
    captured = capture(model, _inputs(7, dtype), [1, None] if made else [1, 3])
    parts = split(captured.gm, SDPA)
    assert _attention_masks(parts) == [dtype, dtype]  # both calls get the float mask
    wheres = [n for p in parts.pieces if not p.is_splitting for n in p.gm.graph.nodes
              if n.target is torch.where]
    assert len(wheres) == 1  # once, in a compiled piece, not per layer
    for t in (5, 7, 12):
        inputs = _inputs(t, dtype)
        with torch.no_grad():
            want = model(*inputs)
            (got,) = parts.stitch(*graph_args(captured.arg_spec, model, inputs))
        assert torch.equal(got, want), (t, (got - want).abs().max())


def test_float_mask_and_unsplit_attention_left_alone():
    model = TwoLayers(made=False).eval()
    float_mask = [_inputs(7)[0], torch.zeros(1, 1, 1, 7)]
    parts = split(capture(model, float_mask, [1, 3]).gm, SDPA)
    assert _attention_masks(parts) == [torch.float32, torch.float32]
    assert not any(n.target is torch.where for p in parts.pieces for n in p.gm.graph.nodes)
    parts = split(capture(TwoLayers().eval(), _inputs(7), [1, None]).gm, ["aotc::attention"])
    assert len(parts.pieces) == 1  # SDPA is not a splitting op here: Inductor sees the whole
    assert not any(n.target is torch.where for n in parts.pieces[0].gm.graph.nodes)
