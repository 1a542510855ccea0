"""aotc: ahead-of-time compile-and-cache for PyTorch model serving.

Importing ``aotc`` is cheap: torch is only imported when ``aotc.compile``, ``aotc.backend`` or
``aotc.load`` is called, so the store commands (``aotc inspect``, ``verify``, ``gc``) answer
without loading torch.

``aotc.compile`` and ``aotc.backend`` are plain functions, whatever was imported before. Their
names are also packages (``aotc/compile/``, ``aotc/backend/``); Python binds a package's name on
its parent when the package is first imported, so both (empty, free to import) are imported here
*before* the functions are defined, and a later ``import aotc.compile.pipeline`` rebinds nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

importlib.import_module("aotc.compile")
importlib.import_module("aotc.backend")

__version__ = "0.1.0"
__all__ = ["backend", "compile", "load", "precompile", "precompiled", "__version__"]


def compile(manifest: Any, store: Any = None, **kwargs: Any) -> Any:  # noqa: A001 - public API name
    """Compile the model a manifest names and store the program; see
    :func:`aotc.compile.pipeline.compile_manifest`."""
    from aotc.compile.pipeline import compile_manifest

    return compile_manifest(manifest, store=store, **kwargs)


def backend(*args: Any, **kwargs: Any) -> Any:
    """A configured ``torch.compile`` backend; see :func:`aotc.backend.serve.backend`."""
    from aotc.backend.serve import backend as configured

    return configured(*args, **kwargs)


def wait_for_merges(timeout: float | None = None) -> bool:
    """Deprecated: returns True at once. The backend's merged programs (compiled whole in a
    background child) were removed in this version, so there is nothing to wait for; the name
    is kept so that callers written for it keep working. ``timeout`` is ignored."""
    del timeout
    return True


def load(manifest: Any = None, model: Any = None, store: Any = None, **kwargs: Any) -> Any:
    """Warm-start a stored program into a runnable: ``aotc.load(manifest)`` or
    ``aotc.load(key=KEY, model=m)``; see :func:`aotc.runtime.loader.load`."""
    from aotc.runtime.loader import load as _load

    return _load(manifest, model=model, store=store, **kwargs)


def precompile(target: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """Trace ``target`` once per example input and store Dynamo's output, so a warm start does
    not trace; see :func:`aotc.dynamo_artifacts.build.precompile`."""
    from aotc.dynamo_artifacts.build import precompile as _precompile

    return _precompile(target, example_inputs, **kwargs)


def precompiled(target: Any, **kwargs: Any) -> Any:
    """``target`` as stored by :func:`precompile`, loaded with no trace (guards checked at every
    call; a miss is traced); see :func:`aotc.dynamo_artifacts.load.precompiled`."""
    from aotc.dynamo_artifacts.load import precompiled as _precompiled

    return _precompiled(target, **kwargs)
