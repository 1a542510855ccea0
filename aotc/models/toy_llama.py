"""A tiny Llama-style decoder used by tests and the demo.

The attention is a custom op, ``aotc::attention``, so the captured FX graph has one opaque call
per layer at which :mod:`aotc.compile.split` cuts the graph. Inputs are a flattened token batch
(``input_ids[T]``, ``positions[T]``); attention is causal over those ``T`` tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["attention", "build", "ToyLlama", "reference_attention"]

_OP_NAME = "aotc::attention"


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain-math causal attention over ``[T, heads, head_dim]`` tensors (the test oracle)."""
    t, _, d = q.shape
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / (d ** 0.5)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v.float())
    return out.to(q.dtype)


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # [T, H, D] -> [H, T, D] for SDPA, causal over the flattened token batch.
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1).contiguous()


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _register() -> Any:
    """Register ``aotc::attention`` once per process (re-import / ``importlib.reload`` safe)."""
    ns, name = _OP_NAME.split("::")
    try:
        return getattr(getattr(torch.ops, ns), name)  # already registered in this process
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(_OP_NAME, mutates_args=())(_attention_impl)
    op.register_fake(_attention_fake)
    return getattr(getattr(torch.ops, ns), name)


attention = _register()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]  # a registered buffer
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos(), emb.sin()


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.input_norm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_norm = RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        h = self.input_norm(x)
        q = self.q_proj(h).view(t, self.heads, self.head_dim)
        k = self.k_proj(h).view(t, self.heads, self.head_dim)
        v = self.v_proj(h).view(t, self.heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = attention(q, k, v).reshape(t, self.heads * self.head_dim)
        x = x + self.o_proj(a)
        h = self.post_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class ToyLlama(nn.Module):
    """Embedding, ``layers`` decoder layers, final norm, lm head."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, intermediate: int) -> None:
        super().__init__()
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError(f"hidden={hidden} must split into {heads} heads of even size")
        self.embed = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // heads)
        self.layers = nn.ModuleList(Layer(hidden, heads, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build(
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    vocab: int = 1024,
    intermediate: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """Build a deterministic (seeded) toy Llama in eval mode.

    ``forward(input_ids: LongTensor[T], positions: LongTensor[T]) -> Tensor[T, vocab]``.
    ``intermediate`` defaults to ``8/3 * hidden`` rounded up to a multiple of 16 (SwiGLU sizing).
    """
    if intermediate is None:
        intermediate = ((8 * hidden // 3) + 15) // 16 * 16
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = ToyLlama(layers, hidden, heads, vocab, intermediate)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 1.0 if name.startswith("embed.") else 0.02)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.eval()
