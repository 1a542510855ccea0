"""``aotc precompile MANIFEST``: :func:`aotc.precompile` of the model a manifest names.

The model is built as ``aotc compile`` builds it; one example input per size (default: the
manifest's ``compile_sizes``), made from its ``inputs`` and passed by name; the entry is named
after the manifest. A server loads it with ``aotc.precompiled(model, name=<manifest name>)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PrecompileResult", "precompile_manifest"]


@dataclass(frozen=True)
class PrecompileResult:
    """What ``aotc precompile`` did: the entry's ``name`` and ``key``, the ``sizes`` traced, the
    graph entries the stored code calls, the ``seconds`` it took and the ``store``."""

    name: str
    key: str
    target: str
    sizes: tuple[int, ...]
    graphs: tuple[str, ...]
    seconds: float
    store: str

    def to_json(self) -> dict[str, Any]:
        """The result as JSON (``--json``)."""
        return {"name": self.name, "key": self.key, "target": self.target, "sizes": list(self.sizes),
                "graphs": list(self.graphs), "seconds": round(self.seconds, 3), "store": self.store}


def precompile_manifest(manifest: Any, sizes: Sequence[int] = (), store: Any = None,
                        remote: Any = None) -> PrecompileResult:
    """Precompile ``manifest``'s model at ``sizes`` tokens (default its ``compile_sizes``, else
    1); ``store``/``remote``: as :func:`aotc.precompile`'s."""
    import torch

    from aotc.errors import PrecompileError
    from aotc.manifest import thaw
    from aotc.model.build import build_model, make_named_inputs
    from aotc.warmstart.build import precompile

    sizes = tuple(sizes) or tuple(manifest.compile_sizes) or (1,)
    bad = [n for n in sizes if not isinstance(n, int) or n < 1]
    if bad:
        raise PrecompileError(f"{manifest.name}: sizes must be positive token counts, got {bad}")
    t0 = time.perf_counter()
    model = build_model(manifest)
    inputs = [make_named_inputs(manifest, n) for n in sizes]
    with torch.no_grad():
        done = precompile(model, inputs, name=manifest.name, store=store, remote=remote, device=manifest.device,
                          splitting_ops=list(manifest.splitting_ops) or None,
                          inductor=thaw(manifest.inductor) or None)
    return PrecompileResult(manifest.name, str(done.key), done.identity, sizes, tuple(done.graph_keys),
                            time.perf_counter() - t0, done.store)
