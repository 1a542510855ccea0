"""``aotc precompile MANIFEST``: :func:`aotc.precompile` of the model a manifest names.

The model is built as ``aotc compile`` builds it; one example input per size (default: the
manifest's ``compile_sizes``), made from its ``inputs`` and passed by name; the entry is named
after the manifest and built with its splitting ops and Inductor patches. A server loads it with
:func:`precompiled_for` (``aotc.precompiled(model, name=<manifest name>, <those options>)``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PrecompileResult", "precompile_file", "precompile_manifest", "precompiled_for"]


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

    load: str = ""  # the call a server makes to load it

    def to_json(self) -> dict[str, Any]:
        """The result as JSON (``--json``)."""
        return {"name": self.name, "key": self.key, "target": self.target, "sizes": list(self.sizes),
                "graphs": list(self.graphs), "seconds": round(self.seconds, 3), "store": self.store,
                "load": self.load}


def precompile_file(path: str, sizes: Sequence[int] = (), store: Any = None, remote: Any = None) -> PrecompileResult:
    """:func:`precompile_manifest` of the manifest file ``path`` (``store``: a callable that
    opens the store for the loaded manifest, or a store); a vLLM manifest is refused: vLLM saves
    Dynamo's output itself."""
    from aotc.errors import PrecompileError
    from aotc.manifest import load_manifest
    from aotc.vllm.manifest import is_vllm_manifest

    if is_vllm_manifest(path):
        raise PrecompileError(f"{path}: a vLLM manifest: vLLM saves Dynamo's output itself (its AOT compile, "
                              "which aotc ships); `aotc compile` it")
    manifest = load_manifest(path)
    return precompile_manifest(manifest, sizes, store=store(manifest) if callable(store) else store, remote=remote)


def _options(manifest: Any) -> dict[str, Any]:
    """The backend options a manifest implies (they are in the precompiled entry's key)."""
    from aotc.manifest import thaw

    return {k: v for k, v in (("splitting_ops", list(manifest.splitting_ops)), ("inductor", thaw(manifest.inductor)))
            if v}


def precompiled_for(manifest: Any, model: Any, **kwargs: Any) -> Any:
    """The server's side of ``aotc precompile MANIFEST``: :func:`aotc.precompiled` of the
    server's own ``model`` under the manifest's name, device and options (``kwargs``: more of
    ``precompiled``'s, e.g. ``store=``)."""
    from aotc.dynamo_artifacts.load import precompiled

    return precompiled(model, name=manifest.name, device=manifest.device, **{**_options(manifest), **kwargs})


def precompile_manifest(manifest: Any, sizes: Sequence[int] = (), store: Any = None,
                        remote: Any = None) -> PrecompileResult:
    """Precompile ``manifest``'s model at ``sizes`` tokens (default its ``compile_sizes``, else
    1); ``store``/``remote``: as :func:`aotc.precompile`'s."""
    import torch

    from aotc.dynamo_artifacts.build import precompile
    from aotc.errors import PrecompileError
    from aotc.model.build import build_model, make_named_inputs

    sizes = tuple(sizes) or tuple(manifest.compile_sizes) or (1,)
    bad = [n for n in sizes if not isinstance(n, int) or n < 1]
    if bad:
        raise PrecompileError(f"{manifest.name}: sizes must be positive token counts, got {bad}")
    t0 = time.perf_counter()
    model = build_model(manifest)
    inputs = [make_named_inputs(manifest, n) for n in sizes]
    options = _options(manifest)
    with torch.no_grad():
        done = precompile(model, inputs, name=manifest.name, store=store, remote=remote, device=manifest.device,
                          **options)
    load = ", ".join([f"name={manifest.name!r}", *(f"{k}={v!r}" for k, v in options.items())])
    return PrecompileResult(manifest.name, str(done.key), done.identity, sizes, tuple(done.graph_keys),
                            time.perf_counter() - t0, done.store, f"aotc.precompiled(model, {load})")
