"""Compiled vs eager on the same inputs and the same state: the compile-time numeric check and
``aotc run --check-eager`` both use it.

Stateful models (a forward that writes its own buffers, such as a KV cache) are compared fairly:
both runs start from one snapshot of every buffer, the buffers either run changed are compared
as outputs too, and the snapshot is restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aotc._torch.wrapper import same_bits


def flat_tensors(out: Any) -> list[Any]:
    """The tensors of a model output, flattened in order (a tensor, or tuples/lists of them)."""
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_tensors(o)]
    return [out]


@dataclass
class Comparison:
    """The outcome of one :func:`compare_runs`: worst errors, what exceeded the tolerance, and
    which buffers the call mutated."""

    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    failures: list[str] = field(default_factory=list)
    mutated: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.failures


def tensor_errors(got: Any, want: Any, atol: float, rtol: float) -> tuple[float, float, bool]:
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) \
            or got.shape != want.shape:
        return float("inf"), float("inf"), False
    g, w = got.detach().float(), want.detach().float()
    diff = (g - w).abs().nan_to_num(0.0)  # NaN where both are NaN counts as equal (equal_nan)
    abs_err = float(diff.max()) if diff.numel() else 0.0
    rel_err = float((diff / w.abs().clamp_min(1e-12)).max()) if diff.numel() else 0.0
    return abs_err, rel_err, bool(torch.allclose(g, w, atol=atol, rtol=rtol, equal_nan=True))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits in every element (a NaN equals a NaN of the same bits, as an uninitialised
    buffer left alone does, and never 0: a buffer that went from 0 to NaN changed); a tensor
    subclass (a quantized weight) by its inner tensors."""
    return same_bits(a, b)


def compare_runs(compiled: Callable[..., Any], eager: Callable[..., Any], inputs: Sequence[Any],
                 buffers: Mapping[str, torch.Tensor], atol: float, rtol: float) -> Comparison:
    """Run ``eager(*inputs)`` and ``compiled(*inputs)`` from the same state — the same snapshot
    of ``buffers`` and each on its own copy of the tensor inputs — and compare their outputs,
    the buffers either one changed and the inputs either one wrote into. The buffers are back at
    the snapshot afterwards."""
    snapshot = {k: b.clone() for k, b in buffers.items()}
    theirs, mine = _copies(inputs), _copies(inputs)
    with torch.no_grad():
        try:
            want = flat_tensors(eager(*theirs))
            eager_state = {k: b.clone() for k, b in buffers.items() if not same(b, snapshot[k])}
            restore(buffers, snapshot)
            got = flat_tensors(compiled(*mine))
            changed = {k for k, b in buffers.items() if not same(b, snapshot[k])}
            mutated = changed | set(eager_state)
            pairs = [(f"buffer {k!r}", buffers[k].clone(), eager_state.get(k, snapshot[k]))
                     for k in sorted(mutated)]
        finally:
            restore(buffers, snapshot)
    result = compare_outputs(got, want, inputs, mine, theirs, atol, rtol, pairs)
    result.mutated = mutated
    return result


def compare_outputs(got: Sequence[Any], want: Sequence[Any], inputs: Sequence[Any],
                    mine: Sequence[Any], theirs: Sequence[Any], atol: float, rtol: float,
                    more: Sequence[tuple[str, Any, Any]] = ()) -> Comparison:
    """Compare two runs on copies of the same ``inputs``: their flat outputs (``got`` against
    ``want``), the inputs either one wrote in place (``mine`` against ``theirs``) and ``more``
    named pairs (a model's buffers)."""
    pairs: list[tuple[str, Any, Any]] = [(f"output {i}", g, w) for i, (g, w) in enumerate(zip(got, want))]
    if len(got) != len(want):
        pairs.append((f"{len(got)} outputs, eager has {len(want)}", None, None))
    pairs += list(more)
    pairs += [(f"input {i} (written in place)", m, t) for i, (x, m, t) in enumerate(zip(inputs, mine, theirs))
              if isinstance(x, torch.Tensor) and not (same(m, x) and same(t, x))]
    result = Comparison()
    for what, g, w in pairs:
        abs_err, rel_err, ok = tensor_errors(g, w, atol, rtol)
        result.max_abs_err = max(result.max_abs_err, abs_err)
        result.max_rel_err = max(result.max_rel_err, rel_err)
        if not ok:
            result.failures.append(f"{what}: max abs err {abs_err:.3g}")
    return result


class NumericReport:
    """The numeric check's figures over its sizes: each size's worst errors and what failed."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol, self.rtol = atol, rtol
        self.sizes: dict[str, dict[str, float]] = {}
        self.failures: list[str] = []

    def add(self, label: str, c: Comparison) -> None:
        """The comparison at one size (``label``: its token count, or ``static``)."""
        self.sizes[label] = {"max_abs_err": c.max_abs_err, "max_rel_err": c.max_rel_err}
        self.failures += [f"{label} tokens, {f}" for f in c.failures]

    def finish(self, differs: str, fix: str, dtype: str = "", **extra: Any) -> dict[str, Any]:
        """The figures as stored with the entry; raises :class:`NumericMismatchError` (``differs``
        from what, beyond the tolerance — for ``dtype`` when given; ``fix``: what the user can
        do) when a size failed, or when no size was checked at all (nothing unchecked is stored)."""
        from aotc.errors import NumericMismatchError

        if not self.sizes:
            raise NumericMismatchError(f"the numeric check ran at no size: whether the {differs} is "
                                       f"not known; nothing was stored ({fix})")
        if self.failures:
            raise NumericMismatchError(
                f"{differs} beyond atol={self.atol}, rtol={self.rtol}" + (f" ({dtype})" if dtype else "")
                + ": " + "; ".join(self.failures[:6]) + f"; nothing was stored ({fix})")
        worst = max((v["max_abs_err"] for v in self.sizes.values()), default=0.0)
        return {"sizes": self.sizes, "max_abs_err": worst, "atol": self.atol, "rtol": self.rtol, **extra}


def _copies(inputs: Sequence[Any]) -> list[Any]:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


@contextlib.contextmanager
def kept(buffers: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """The block may run the model (warm-up, graph capture): the buffers it writes (a KV cache)
    are put back as they were, however the block ends."""
    snapshot = {k: b.clone() for k, b in buffers.items()}
    try:
        yield
    finally:
        restore(buffers, snapshot)


def restore(buffers: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]) -> None:
    """Put every buffer back to its snapshot (those that changed)."""
    with torch.no_grad():
        for k, b in buffers.items():
            if not same(b, snapshot[k]):
                b.copy_(snapshot[k])


__all__: Sequence[str] = ["Comparison", "NumericReport", "compare_outputs", "compare_runs", "flat_tensors",
                         "kept", "restore", "same", "tensor_errors"]
